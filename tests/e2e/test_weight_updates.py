"""The research loop (docs/research_loop.md): update_weights from a dict, a folder (safetensors
and orbax) or the engine's own pytree gives a fresh engine's outputs on the new
checkpoint, with no compile; partial updates; bad input is a clear error and the old
weights keep serving; sleep / wake; pause / resume; generate() waits while asleep."""
import threading
import time

import jax
from flax import nnx
import numpy as np
import pytest
from compile_counter import count_compiles
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
          compilation_cache=False, progress=False)
PROMPTS = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 500, 5 + 9 * i).tolist()} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def run(llm):
    """(tokens, logprobs of the chosen tokens) per prompt."""
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])


def assert_same(got, want):
    assert got[0] == want[0]
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), atol=1e-4)


def tensors(path):
    return load_file(str(path / "model.safetensors"))


def cached_blocks(llm) -> int:
    return sum(len(s.kv_cache_manager.block_pool.cached_block_hash_to_block)
               for s in llm.llm_engine.engine_core.schedulers)


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models("llama", seed=0), tiny_models("llama", seed=1)


@pytest.fixture(scope="module")
def fresh(models):
    """Each checkpoint's outputs from an engine built on it."""
    out = []
    for path in models:
        llm = LLM(str(path), **KW)
        out.append(run(llm))
        del llm
    assert out[0][0] != out[1][0]
    return out


def test_dict_folder_orbax_and_pytree_updates_match_a_fresh_engine_with_no_compile(models, fresh, tmp_path):
    from models.checkpoint import convert_to_orbax

    a, b = models
    orbax_b = convert_to_orbax(b, tmp_path / "orbax_b", progress=False)
    llm = LLM(str(a), **KW)
    runner = llm.llm_engine.model_runner
    assert_same(run(llm), fresh[0])
    assert cached_blocks(llm) > 0
    steps = [(tensors(b), 1), (str(a), 0), (str(orbax_b), 1), (tensors(a), 0), (str(orbax_b), 1)]
    for version, (weights, want) in enumerate(steps, 1):
        with count_compiles(runner) as compiles:
            info = llm.update_weights(weights)
        assert info["version"] == version == llm.weights_version
        # No serving program recompiles; orbax's restore compiles its own helpers on first use.
        assert compiles[1] == 0 and (compiles[0] == 0 or version == 3), (version, compiles)
        assert cached_blocks(llm) == 0  # the old weights' KV is not reused
        assert_same(run(llm), fresh[want])
    # The engine's own pytree comes back with no copy and nothing through the host.
    params = llm.get_params()
    with jax.transfer_guard_device_to_host("disallow"), count_compiles(runner) as compiles:
        llm.update_weights(params)
    assert compiles == [0, 0]
    assert runner.state["layers"]["q_proj"].get_value() is params["layers"]["q_proj"].get_value()
    # A trainer's new arrays (float64 on the host too) in the same structure.
    other = LLM(str(b), **KW).get_params()
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(other))
    pure["norm"] = pure["norm"].astype(np.float64)
    llm.update_weights(pure)
    assert_same(run(llm), fresh[1])


def test_partial_updates_and_bad_input(models, fresh):
    a, b = models
    llm = LLM(str(b), **KW)
    ta = tensors(a)
    # Layer 1 first, then layer 0 and the rest: a, in two partial updates.
    llm.update_weights({k: v for k, v in ta.items() if ".layers.1." in k})
    assert run(llm)[0] not in (fresh[0][0], fresh[1][0])
    llm.update_weights({k: v for k, v in ta.items() if ".layers.1." not in k})
    assert_same(run(llm), fresh[0])
    version = llm.weights_version
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        ({"model.layers.0.self_attn.nope.weight": ta[q]}, "'model.layers.0.self_attn.nope.weight' is not a parameter"),
        ({q: ta[q][:, :8]}, f"'{q}' has shape \\(64, 8\\); this model's is \\(64, 64\\)"),
        ({q: ta[q].astype(np.int32)}, f"weights\\['{q}'\\]: dtype int32 is not a float dtype"),
        ({"model.layers.2.self_attn.q_proj.weight": ta[q]}, "is not a parameter"),  # 2 layers: 0 and 1
        ({("layers", "q_proj"): ta[q]}, "names must be str"),
        ({"layers": {"q_proj": np.zeros((2, 64, 8), np.float32)}}, "'layers/q_proj' has shape \\(2, 64, 8\\)"),
        ({"layers": {"nope": np.zeros(3, np.float32)}}, "'layers/nope' is not a param of the served model"),
        (str(a) + "/missing", "is not a model folder"),
        (42, "weights: a folder path"),
    ]
    for weights, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            llm.update_weights(weights)
    assert llm.weights_version == version
    assert_same(run(llm), fresh[0])  # the old weights still serve


@pytest.mark.parametrize("arch,kw", [("llama", dict(scan_layers=False)), ("llama", dict(weight_dtype="bfloat16")),
                                     ("llama", dict(quantization="int8")), ("qwen3_moe", {}), ("deepseek_v3", {})])
def test_partial_updates_in_every_layout(tiny_models, arch, kw):
    """Layer 1, then the rest, of checkpoint a onto an engine on b: a's outputs, with the
    layers unrolled (an array per layer), stored as bf16 bit patterns, int8 with scales,
    MoE experts stacked per layer (a layer must come with all its experts), and
    DeepSeek-V3's two stacks (layer 0 dense, layer 1 MoE with the routing's correction
    bias, MLA's latent projections)."""
    a, b = tiny_models(arch, seed=0), tiny_models(arch, seed=1)
    kw = dict(kw, enforce_eager=True)  # the programs a few steps use, compiled on first use
    want = run(LLM(str(a), **KW, **kw))
    llm = LLM(str(b), **KW, **kw)
    ta = tensors(a)
    if arch in ("qwen3_moe", "deepseek_v3"):
        one_short = {k: v for k, v in ta.items() if ".layers.1.mlp.experts." in k and ".experts.3." not in k}
        with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.3.\w+.weight' is missing"):
            llm.update_weights(one_short)
    llm.update_weights({k: v for k, v in ta.items() if ".layers.1." in k})
    assert run(llm)[0] != want[0]
    llm.update_weights({k: v for k, v in ta.items() if ".layers.1." not in k})
    assert_same(run(llm), want)


def test_sleep_and_wake(models, fresh):
    a, b = models
    llm = LLM(str(a), **KW)
    runner = llm.llm_engine.model_runner
    before = runner.memory_usage()
    assert before["weights"] > 0 and before["kv_cache"] > 0
    with count_compiles(runner) as compiles:
        freed = llm.sleep(1)
        assert llm.is_sleeping() and freed == {"weights": 0, "kv_cache": before["kv_cache"]}
        assert runner.memory_usage() == {"weights": before["weights"], "kv_cache": 0}
        llm.wake_up()
        assert not llm.is_sleeping()
        assert_same(run(llm), fresh[0])
        # Level 2: the weights too; wake_up re-reads them from the model's folder.
        assert llm.sleep(2) == before and runner.memory_usage() == {"weights": 0, "kv_cache": 0}
        llm.wake_up(["kv_cache"])
        assert llm.is_sleeping()
        llm.wake_up(["weights"])
        assert not llm.is_sleeping()
    assert compiles == [0, 0]
    assert_same(run(llm), fresh[0])
    # Weights from arrays cannot be re-read: an update while asleep gives them.
    llm.update_weights(tensors(b))
    llm.sleep(2)
    with pytest.raises(RuntimeError, match="call update_weights"):
        llm.wake_up()
    with pytest.raises(RuntimeError, match="the weights are freed"):
        llm.sequence_logprobs([1, 2, 3])
    with pytest.raises(ValueError, match="the weights are freed"):
        llm.update_weights({k: v for k, v in tensors(a).items() if ".layers.1." in k})
    llm.update_weights(tensors(b))
    llm.wake_up()
    assert_same(run(llm), fresh[1])
    with pytest.raises(ValueError, match="level: 1"):
        llm.sleep(3)

    # Requests made while asleep wait for wake_up() (from another thread).
    llm.sleep(1)
    done = {}
    worker = threading.Thread(target=lambda: done.update(out=run(llm)))
    worker.start()
    time.sleep(0.5)
    assert worker.is_alive() and "out" not in done
    llm.wake_up()
    worker.join(60)
    assert_same(done["out"], fresh[1])

    # sleep() while another thread's generate() runs: its requests finish first, and
    # those made after it wait (the engine must not run without its KV cache).
    long = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    first = threading.Thread(target=lambda: done.update(first=llm.generate(PROMPTS, long, use_tqdm=False)))
    first.start()
    while llm.llm_engine.engine_core.num_running() == 0:
        time.sleep(0.002)
    llm.sleep(1)
    first.join(60)
    assert {o.outputs[0].finish_reason for o in done["first"]} == {"length"}
    later = threading.Thread(target=lambda: done.update(later=run(llm)))
    later.start()
    time.sleep(0.3)
    assert later.is_alive() and llm.is_sleeping()
    llm.wake_up()
    later.join(60)
    assert_same(done["later"], fresh[1])

    # sleep(2) drops the engine's references, never a trainer's arrays handed over with no copy.
    params = llm.get_params()
    llm.update_weights(params)
    llm.sleep(2)
    assert np.isfinite(np.asarray(params["norm"].get_value())).all()
    llm.update_weights(params)  # the trainer's arrays again, while asleep
    llm.wake_up()
    assert_same(run(llm), fresh[1])
    llm.update_weights({"norm": np.asarray(params["norm"].get_value())})  # a top-level param as a pytree


def test_pause_wait_and_abort_offline(models, monkeypatch):
    a, _ = models
    llm = LLM(str(a), **KW)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    core = llm.llm_engine.engine_core
    step = core.step

    def slow_step():  # 100 steps take 2 s: the pause lands while the requests run
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(core, "step", slow_step)
    for mode in ("abort", "wait"):
        done = {}
        worker = threading.Thread(target=lambda: done.update(out=llm.generate(PROMPTS, long, use_tqdm=False)))
        worker.start()
        while llm.llm_engine.engine_core.num_running() == 0:
            time.sleep(0.005)
        llm.pause_generation(mode)  # returns once nothing runs
        assert llm.is_paused() and llm.llm_engine.engine_core.is_idle()
        worker.join(60)
        reasons = {o.outputs[0].finish_reason for o in done["out"]}
        lengths = {len(o.outputs[0].token_ids) for o in done["out"]}
        if mode == "abort":
            assert reasons == {"abort"} and max(lengths) < 100
        else:
            assert reasons == {"length"} and lengths == {100}
        # Held while paused: a new generate() waits for resume_generation().
        later = threading.Thread(target=lambda: done.update(later=run(llm)))
        later.start()
        time.sleep(0.3)
        assert "later" not in done and llm.llm_engine.engine_core.num_running() == 0
        llm.resume_generation()
        later.join(60)
        assert len(done["later"][0]) == len(PROMPTS)


@pytest.mark.devices(4)
@pytest.mark.parametrize("arch,kw", [("qwen3_moe", dict(tensor_parallel_size=2)),
                                     ("qwen3_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
                                     ("llama", dict(tensor_parallel_size=2, data_parallel_size=2,
                                                    weight_dtype="bfloat16")),
                                     ("llama", dict(quantization="int8")),
                                     ("phi3", dict(tensor_parallel_size=2))])  # fused qkv / gate_up at tp 2
def test_update_under_tp_dp_ep_moe_and_quantization(tiny_models, arch, kw):
    """A MoE model at tp 2 and expert parallel 2, a bf16-weight model at tp 2 x dp 2, an
    int8 model re-quantized, and Phi-3's fused tensors (each feeding several params) at
    tp 2: a dict update gives the fresh engine's outputs."""
    a, b = tiny_models(arch, seed=0), tiny_models(arch, seed=1)
    kw = dict(kw, enforce_eager=True)  # the programs a few steps use, compiled on first use
    want = run(LLM(str(b), **KW, **kw))
    llm = LLM(str(a), **KW, **kw)
    assert run(llm)[0] != want[0]
    with count_compiles(llm.llm_engine.model_runner) as compiles:
        llm.update_weights(tensors(b))
    assert compiles[1] == 0  # no new variant of a serving program (the int8 quantizer may compile once)
    assert_same(run(llm), want)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])  # gemma: sliding layers, soft caps
def test_trainer_logprobs_fn_agrees_with_the_engine_and_differentiates(tiny_models, arch):
    llm = LLM(str(tiny_models(arch, seed=0)), **KW, dtype="float32", weight_dtype="float32", enforce_eager=True)
    fn = llm.get_logprobs_fn()
    ids = np.random.default_rng(0).integers(3, 500, 30).astype(np.int32)  # longer than the 8-token window
    params = llm.get_params()
    np.testing.assert_allclose(np.asarray(fn(params, ids)), llm.sequence_logprobs(ids)[0], atol=1e-4)
    grads = jax.grad(lambda p: fn(p, ids).sum())(params)
    norms = [float(np.linalg.norm(np.asarray(g))) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and min(norms) > 0
