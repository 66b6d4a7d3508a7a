"""Each model file declares its params' partitioning (nnx sharding metadata); the
loader reads every param straight into it (never built on the host, then placed)."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_factory import make_tiny_hf_model
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.loader import load_model
from models.registry import _MODEL_REGISTRY, get_model_class

# The tensor-parallel layout (docs/design.md §5); every other variable is replicated.
COLUMN, ROW, COLUMN_BIAS = P(None, None, "model"), P(None, "model", None), P(None, "model")
EXPECTED = {
    **dict.fromkeys(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], COLUMN),
    **dict.fromkeys(["o_proj", "down_proj"], ROW),
    **dict.fromkeys(["q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"], COLUMN_BIAS),
    "lm_head": P(None, "model"),
    "embed_tokens": P("model", None),  # split by vocabulary (padded to a multiple of tp)
}


def _tiny_mistral(path):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32)
    transformers.MistralForCausalLM(cfg).float().save_pretrained(path)
    return path


CASES = {
    "llama-biases": (lambda p: make_tiny_hf_model(p, "llama", attention_bias=True, mlp_bias=True),
                     {"o_bias", "down_bias", "lm_head", "gate_bias"}),
    "qwen2": (lambda p: make_tiny_hf_model(p, "qwen2"), {"q_bias", "lm_head"}),
    "qwen3-tied": (lambda p: make_tiny_hf_model(p, "qwen3", tie=True), {"q_norm", "k_norm"}),
    "mistral": (_tiny_mistral, {"lm_head"}),
}


@pytest.mark.devices(2)  # fails, not skips, with fewer (tests/conftest.py)
@pytest.mark.parametrize("case", list(CASES))
def test_params_carry_their_partitioning(tmp_path, case):
    make, must_have = CASES[case]
    path = make(tmp_path / case)
    tp = 2
    mesh = Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))
    arch, _graphdef, state = load_model(path, mesh=mesh, dtype=jnp.bfloat16, progress=False)
    specs = nnx.get_partition_spec(state)
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
    names = set()
    for (keys, var), spec in zip(leaves, spec_leaves):
        name = str(keys[-1].key)
        names.add(name)
        x = var.get_value()
        if isinstance(var, nnx.Param):
            want = EXPECTED.get(name, P(*[None] * x.ndim))
            assert not var.get_metadata()["eager_sharding"], name  # placed by the loader, not by nnx
            assert spec.get_value() == want, name
            assert x.sharding.spec == want, name
            assert x.dtype == jnp.bfloat16, name
        else:  # rope inv_freq: not a Param, so neither cast nor sharded
            assert name == "inv_freq"
            assert x.dtype == jnp.float32 and x.sharding.is_fully_replicated
    assert must_have <= names
    assert ("lm_head" in names) == (not arch.tie_word_embeddings)
    if case == "mistral":
        assert arch.sliding_window == 32


def test_every_registered_architecture_is_declared_by_its_class():
    for arch in _MODEL_REGISTRY:
        assert arch in get_model_class(arch).architectures


def test_config_does_not_import_the_models():
    """models.config -> models.registry must not import a model (which imports models.config)."""
    code = "import sys, models.config; assert not any(m in sys.modules for m in ('models.llama', 'flax')), 1"
    subprocess.run([sys.executable, "-c", code], check=True)
