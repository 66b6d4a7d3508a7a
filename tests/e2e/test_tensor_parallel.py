"""Tensor parallelism is a change of mesh: the single-device greedy tokens, with a
vocabulary tp does not divide (padded; padded ids never sampled nor in logprobs) and
fewer KV heads than devices (replicated)."""
import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

VOCAB = 1013


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 host devices (XLA_FLAGS in tests/conftest.py)")
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
