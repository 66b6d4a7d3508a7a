"""Batch-invariant mode (docs/batch_invariance.md): one request's tokens and logprobs are
bitwise the same alone, among 63 others, with its prefill chunked at other budgets, on
either of two data-parallel ranks and with n-gram speculation; a seeded sampled request
too; and the trainer-side logprobs (LLM.sequence_logprobs) equal the sampled ones.

Under the default precision: dtype auto, i.e. bf16 matmul weights on a CPU with
AVX512-BF16 (the native kernel then takes every product) and float32 elsewhere."""
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
ENGINE = dict(max_model_len=256, max_num_seqs=64, kv_cache_memory=16 << 20, progress=False,
              batch_invariant=True)
RNG = np.random.default_rng(0)
# Repeated 5-grams so that the n-gram proposer has drafts that get accepted and rejected.
_MOTIF = RNG.integers(3, 400, 5).tolist()
PROMPT = (RNG.integers(3, 400, 20).tolist() + _MOTIF) * 2 + RNG.integers(3, 400, 20).tolist()
OTHERS = [RNG.integers(3, 400, int(n)).tolist() for n in RNG.integers(5, 120, 63)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", vocab=512, layers=2)


def _first(llm, others=(), sp=GREEDY):
    """(token ids, [[(id, logprob), ...] per position]) of PROMPT's output, run with ``others``."""
    prompts = [{"prompt_token_ids": p} for p in [PROMPT, *others]]
    out = llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [sorted((i, lp.logprob) for i, lp in d.items()) for d in out.logprobs]


@pytest.fixture(scope="module")
def alone(model):
    llm = LLM(str(model), **ENGINE)
    return llm, _first(llm), _first(llm, sp=SEEDED)


def test_among_63_others_and_one_large_step(model, alone):
    _, want, want_seeded = alone
    # Every prompt in one step (a 4096-token bucket: XLA's RMSNorm changed a row's bits
    # there), then 64 rows decoding together.
    llm = LLM(str(model), **{**ENGINE, "max_num_batched_tokens": 8192})
    assert _first(llm, OTHERS) == want
    assert _first(llm, OTHERS, SEEDED) == want_seeded


@pytest.mark.parametrize("budget", [16, 24, 40])
def test_chunked_prefill_budgets(model, alone, budget):
    llm = LLM(str(model), **{**ENGINE, "max_num_batched_tokens": budget, "max_num_seqs": 8})
    assert _first(llm, OTHERS[:5]) == alone[1]


def test_ngram_speculation_is_exact(model, alone):
    # Every draft verified (adaptive_drafts off): the budget's choice goes by measured
    # step times, and the accepted-drafts check below must not depend on the machine's load.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "adaptive_drafts": False}
    llm = LLM(str(model), **{**ENGINE, "max_num_seqs": 8}, speculative_config=spec)
    assert _first(llm) == alone[1]
    assert _first(llm, OTHERS[:7]) == alone[1]
    # Drafts were proposed and some accepted: the verify steps scored several positions.
    assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0
    # A seeded request draws other tokens with drafts than without (acceptance has its
    # own stream), but the same alone as among others.
    assert _first(llm, sp=SEEDED) == _first(llm, OTHERS[:7], SEEDED)


def test_draft_model_speculation_is_exact(model, tiny_models, alone):
    draft = tiny_models("llama", vocab=512, layers=1, seed=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(model), **{**ENGINE, "max_num_seqs": 8}, speculative_config=spec)
    assert _first(llm, OTHERS[:7]) == alone[1]
    # The draft model's products are batch-invariant too: a seeded request's drafts, and
    # so its accepts and draws, are the same alone and among others.
    assert _first(llm, sp=SEEDED) == _first(llm, OTHERS[:7], SEEDED)
    assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.devices(2)
def test_data_parallel_ranks(model, alone):
    llm = LLM(str(model), **{**ENGINE, "max_num_seqs": 8}, data_parallel_size=2)
    # PROMPT is admitted first (rank 0), then again after 9 others: on rank 1 by the
    # balancer's alternation or among other rows on rank 0: each copy equals it alone.
    prompts = [PROMPT, *OTHERS[:9], PROMPT]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for o in (outs[0], outs[-1]):
        got = list(o.outputs[0].token_ids), [sorted((i, lp.logprob) for i, lp in d.items())
                                             for d in o.outputs[0].logprobs]
        assert got == alone[1]


def test_trainer_logprobs_equal_the_sampled_ones(alone):
    llm, (tokens, logprobs), (seeded_tokens, seeded_logprobs) = alone
    for ids, lps in ((tokens, logprobs), (seeded_tokens, seeded_logprobs)):
        sampled = np.array([dict(d)[t] for d, t in zip(lps, ids)], np.float32)
        dense = llm.sequence_logprobs(PROMPT + ids)[0]
        assert dense.shape == (len(PROMPT) + len(ids) - 1,)
        np.testing.assert_array_equal(dense[-len(ids):], sampled)
    with pytest.raises(ValueError, match="token_ids"):
        llm.sequence_logprobs([5])
    with pytest.raises(ValueError, match=r"token_ids: ids must be in \[0, 512\)"):
        llm.sequence_logprobs([5, 512])


def test_the_flag_reaches_the_kernels_and_vllm_env(model, monkeypatch):
    from jaxserve.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    config = EngineArgs(model=str(model)).create_engine_config(progress=False)
    assert config.model_config.batch_invariant
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert not EngineArgs(model=str(model)).create_engine_config(progress=False).model_config.batch_invariant
