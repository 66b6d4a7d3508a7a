"""`jaxserve convert MODEL OUT --format orbax`: the serving params as an orbax
checkpoint (the tp=1 layout), restored straight into any tp's shardings; the folder is
served like the HF folder it came from."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_factory import make_tiny_hf_model
from jax.sharding import Mesh

from jaxserve import LLM, SamplingParams
from jaxserve.cli import main
from models.checkpoint import ORBAX_MARKER
from models.loader import load_model


def mesh_of(tp):
    return Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))


def params(state):
    return {k: var[...] for k, var in nnx.to_flat_state(nnx.state(state, nnx.Param))}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orbax")
    hf = make_tiny_hf_model(tmp / "hf", "qwen2", vocab=1013, kv_heads=2)  # q/k/v biases: more KV params
    assert main(["convert", str(hf), str(tmp / "orbax")]) == 0  # default format for a folder: orbax
    assert main(["convert", str(hf), str(tmp / "orbax-bf16"), "--format", "orbax", "--dtype", "bfloat16"]) == 0
    return hf, tmp / "orbax", tmp / "orbax-bf16"


def test_folder_contents(folders, capsys):
    hf, orbax, orbax_bf16 = folders
    names = {p.name for p in orbax.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", ORBAX_MARKER,
            "params"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    assert json.loads((orbax / ORBAX_MARKER).read_text())["dtype"] == "float32"  # auto: the checkpoint's own
    marker = json.loads((orbax_bf16 / ORBAX_MARKER).read_text())
    assert marker["dtype"] == "bfloat16"
    assert marker["params"]["embed_tokens"] == [1013, 64]  # stored unpadded (the tp=1 layout)
    capsys.readouterr()
    assert main(["convert", str(hf), str(orbax)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["convert", str(hf), str(tmp_out := orbax.parent / "x"), "--format", "hf"]) == 2
    assert "converts a .gguf file" in capsys.readouterr().err and not tmp_out.exists()


@pytest.mark.parametrize("tp", [1, 4])  # 4: vocabulary padded on restore, KV heads replicated after it
def test_params_equal_safetensors(folders, tp):
    hf, orbax, orbax_bf16 = folders
    arch_hf, _, state_hf = load_model(hf, mesh=mesh_of(tp), dtype=jnp.float32, progress=False)
    arch_ob, _, state_ob = load_model(orbax, mesh=mesh_of(tp), dtype=jnp.float32, progress=False)
    assert arch_ob == arch_hf
    a, b = params(state_hf), params(state_ob)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].sharding == a[k].sharding, k
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=str(k))
    # A bf16 folder served in bf16 holds what the safetensors loader casts to bf16.
    _, _, state_hf16 = load_model(hf, mesh=mesh_of(tp), dtype=jnp.bfloat16, progress=False)
    _, _, state_ob16 = load_model(orbax_bf16, mesh=mesh_of(tp), dtype=jnp.bfloat16, progress=False)
    a, b = params(state_hf16), params(state_ob16)
    for k in a:
        assert b[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=str(k))


def test_llm_serves_the_orbax_folder(folders):
    hf, orbax, _ = folders
    prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 1000, 4 + 7 * i).tolist()} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for path in (hf, orbax):
        llm = LLM(str(path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, enforce_eager=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        assert llm.llm_engine.vocab_size == 1013
    assert outs[0] == outs[1]
