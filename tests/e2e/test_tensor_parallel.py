"""Tensor parallelism is a change of mesh: the single-device greedy tokens, with a
vocabulary tp does not divide (padded; padded ids never sampled nor in logprobs) and
fewer KV heads than devices (replicated)."""
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

VOCAB = 1013


@pytest.mark.devices(4)  # fails, not skips, with fewer (tests/conftest.py)
@pytest.mark.parametrize("backend,tp", [("reference", 4), ("pallas", 2)])  # pallas: interpreted, under shard_map
def test_tp_matches_tp1(tiny_models, backend, tp):
    path = tiny_models("qwen2", kv_heads=2, vocab=VOCAB)  # 4 heads, 2 KV heads
    ps = [{"prompt_token_ids": np.random.default_rng(i).integers(3, VOCAB, 5 + 9 * i).tolist()} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    # Random sampling over the whole vocabulary (the padding's logits would be 0, not -inf).
    hot = SamplingParams(temperature=2.0, max_tokens=48, ignore_eos=True, logprobs=5, seed=0)
    res = []
    for size in (1, tp):
        llm = LLM(str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, tensor_parallel_size=size,
                  # reference: warm-up executables serve the steps; pallas (interpreted): jit on demand
                  enforce_eager=backend == "pallas", attention_backend=backend)
        runner = llm.llm_engine.model_runner
        kv_heads = max(2, size)
        assert (runner.arch.num_key_value_heads, runner.vocab_size) == (kv_heads, VOCAB)
        assert runner.arch.padded_vocab_size == -(-VOCAB // size) * size
        if size > 1:
            # KV heads and attention-head columns really are split over the 'model' axis.
            assert runner.kv_cache.sharding.spec[3] == "model" and runner.kv_cache.shape[3] == 2 * kv_heads
            assert tuple(runner.state["layers"]["q_proj"][...].sharding.spec) == (None, None, "model")
            assert len(runner.kv_cache.sharding.device_set) == size
            # Attention runs per device on its own heads (shard_map): nothing is gathered.
            hlo = runner.lower_model_step(16)
            assert "all-gather" not in hlo.compile().as_text()
        out = llm.generate(ps, sp, use_tqdm=False)
        res.append([o.outputs[0].token_ids for o in out])
        if backend == "reference":
            for o in out + llm.generate(ps[:2], hot, use_tqdm=False):
                c = o.outputs[0]
                assert max(c.token_ids) < VOCAB and all(max(step) < VOCAB for step in c.logprobs)
    assert res[0] == res[1]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4; valid sizes"):
        LLM(str(path), tensor_parallel_size=3, compilation_cache=False, progress=False, kv_cache_memory=4 << 20,
            max_model_len=128)


@pytest.mark.devices(4)  # fails, not skips, with fewer (tests/conftest.py)
def test_moe_tensor_and_expert_parallel_match_one_device(tiny_models):
    """Qwen3-MoE (8 experts, top 2): experts split by their mlp dim (tp 2) or whole per
    device (expert parallel 2 and 4) give the single-device tokens and logprobs."""
    path = tiny_models("qwen3_moe", kv_heads=2, seed=1)
    ps = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 500, 5 + 9 * i).tolist()} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    res = []
    for tp, ep in [(1, False), (2, False), (2, True), (4, True)]:
        llm = LLM(str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, tensor_parallel_size=tp, enable_expert_parallel=ep,
                  # float32: one-device logprobs to 1e-4 (bf16 matmul weights under a split moved one by 1.2e-4)
                  enforce_eager=True, dtype="float32")
        spec = llm.llm_engine.model_runner.state["layers"]["experts_gate"][...].sharding.spec
        assert tuple(spec) == ((None, "model", None, None) if ep else (None, None, None, "model"))
        out = llm.generate(ps, sp, use_tqdm=False)
        res.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                    for o in out])
    for other in res[1:]:
        for (toks, lps), (toks1, lps1) in zip(other, res[0]):
            assert toks == toks1
            np.testing.assert_allclose(lps, lps1, atol=1e-4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tiny_models("qwen2", kv_heads=2)), tensor_parallel_size=2, enable_expert_parallel=True,
            compilation_cache=False, progress=False, kv_cache_memory=4 << 20, max_model_len=128)
