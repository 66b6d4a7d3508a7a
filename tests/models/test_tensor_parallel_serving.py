"""Served through the engine, a tp that pads the vocabulary and replicates KV heads gives
the single-device tokens, and no padded id is ever sampled or listed in logprobs."""
import jax
import numpy as np
import pytest
from hf_factory import make_tiny_hf_model

from jaxserve import LLM, SamplingParams

VOCAB = 1013


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 host devices (XLA_FLAGS in tests/conftest.py)")
def test_tp4_padded_vocab_and_replicated_kv_heads_match_tp1(tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", "llama", vocab=VOCAB, kv_heads=2)  # 4 heads, 2 KV heads
    prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(3, VOCAB, 5 + 9 * i).tolist()} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    # Random sampling over the whole vocabulary (the padding's logits would be 0, not -inf).
    hot = SamplingParams(temperature=2.0, max_tokens=64, ignore_eos=True, logprobs=5, seed=0)
    res = []
    for tp in (1, 4):
        llm = LLM(str(path), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, tensor_parallel_size=tp, enforce_eager=True)
        runner = llm.llm_engine.model_runner
        assert (runner.arch.num_key_value_heads, runner.arch.padded_vocab_size) == ((2, VOCAB) if tp == 1 else (4, 1016))
        assert runner.vocab_size == VOCAB
        if tp == 4:
            assert runner.kv_cache.shape[3] == 2 * 4 and runner.kv_cache.sharding.spec[3] == "model"
        out = llm.generate(prompts, greedy, use_tqdm=False)
        res.append([o.outputs[0].token_ids for o in out])
        for o in out + llm.generate(prompts, hot, use_tqdm=False):
            c = o.outputs[0]
            assert max(c.token_ids) < VOCAB
            assert all(max(step) < VOCAB for step in c.logprobs)
    assert res[0] == res[1]
