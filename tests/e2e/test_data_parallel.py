"""Data parallelism is one SPMD program over a (data, model) mesh: each rank has its own
scheduler and KV pages, and the tokens are those of a single device."""
import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.devices(8)  # fails, not skips, with fewer (tests/conftest.py)
# float32: the test asks for the one-device tokens and logprobs (1e-4). With bf16 matmul
# weights (dtype auto on a CPU with AVX512-BF16) a tp split changes the products'
# reduction order and bf16 rounding moved a logprob by 2e-3 on an AMD EPYC VM.
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=2 << 20,
              compilation_cache=False, progress=False, dtype="float32")


def _requests():
    """Mixed lengths (chunked prefill at 64 tokens a step), greedy and seeded sampling,
    logprobs and prompt logprobs, a shared prefix."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 1000, 40).tolist()
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 90, 17, 33, 2, 70)]
    prompts += [prefix + [5, 6], prefix + [7]]
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in prompts]
    sps[1] = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True)
    sps[2] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    return [{"prompt_token_ids": p} for p in prompts], sps


def _run(llm):
    prompts, sps = _requests()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return outs, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tiny_models):
    # Vocabulary and KV heads that tp 4 does not divide: padded and replicated.
    return tiny_models("qwen2", kv_heads=2, vocab=1013)


@pytest.fixture(scope="module")
def reference(model):
    return _run(LLM(str(model), enforce_eager=True, **ENGINE))


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (2, 2), (2, 4)])
def test_data_parallel_matches_one_device(model, reference, dp, tp):
    llm = LLM(str(model), data_parallel_size=dp, tensor_parallel_size=tp, **ENGINE)
    runner, core = llm.llm_engine.model_runner, llm.llm_engine.engine_core
    assert runner.mesh.shape == {"data": dp, "model": tp}
    # Each device holds one rank's pages and 1/tp of its (replicated) KV heads.
    kv = runner.kv_cache
    per_device = {s.data.nbytes for s in kv.addressable_shards}
    assert per_device == {kv.nbytes // (dp * tp)}
    assert kv.shape[1] == dp * runner.num_blocks
    with count_compiles(runner) as compiled:
        outs, tokens = _run(llm)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"
    ref_outs, ref_tokens = reference
    assert tokens == ref_tokens
    for o, r in zip(outs, ref_outs):
        if r.prompt_logprobs:
            assert [list(d) for d in o.prompt_logprobs[1:]] == [list(d) for d in r.prompt_logprobs[1:]]
        if r.outputs[0].logprobs:
            got = [[v.logprob for v in d.values()] for d in o.outputs[0].logprobs]
            want = [[v.logprob for v in d.values()] for d in r.outputs[0].logprobs]
            np.testing.assert_allclose(got, want, atol=1e-4)
    # Both ranks served requests, and every block came back.
    admitted = [s.prefix_cache_stats.requests for s in core.make_rank_stats()]
    assert all(a > 0 for a in admitted) and sum(admitted) == len(outs), admitted
    for sched in core.schedulers:
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not sched.requests


def test_invalid_mesh_sizes_are_clear_errors(model):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(model), data_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="exceeds the 8 available devices"):
        LLM(str(model), data_parallel_size=4, tensor_parallel_size=4, **ENGINE)
