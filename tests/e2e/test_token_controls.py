"""logit_bias, allowed_token_ids and bad_words (vLLM's SamplingParams fields) on a tiny
random Llama, float32: greedy outputs equal HF's logits with the same controls applied
(a reference written here, with numpy), up to HF's first near-tie; requests with and
without controls share steps without leaking into each other; a sampled request keeps
to its allowed tokens; nothing compiles after the warm-up."""
import numpy as np
import pytest
from compile_counter import count_compiles
from hf_reference import HFReference, assert_greedy_match

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
N = 12


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=8 << 20,
               compilation_cache=False, progress=False, dtype="float32")


def reference(hf: HFReference, prompt, n, *, bias=None, allowed=None, bad=()):
    """Greedy tokens and top-2 margins with the controls applied to HF's logits: the bias
    added, tokens outside ``allowed`` and banned bad-word tokens at -inf (a multi-token
    sequence's last token where the output so far ends with the rest)."""
    def process(logits, out):
        for t, b in (bias or {}).items():
            logits[t] += b
        if allowed is not None:
            keep = np.full_like(logits, -np.inf)
            keep[allowed] = logits[allowed]
            logits = keep
        for seq in bad:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[len(out) - len(seq) + 1:] == list(seq[:-1])):
                logits[seq[-1]] = -np.inf
        return logits

    return hf.greedy(prompt, n, process)


def greedy(**kw):
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw)


def test_controls_equal_the_reference_in_one_batch(llm, model):
    hf = HFReference(model)
    prompts = [[5, 6, 7, 8], [40, 41], [100, 7, 300, 9, 11], [17, 18, 19], [250, 251, 252]]
    plain, _ = reference(hf, prompts[1], N)
    cases = [
        dict(bias={plain[2]: -100.0, 77: 5.0}),
        dict(),
        dict(allowed=[10, 11, 12, 13, 200, 300]),
        dict(bad=((plain[0],), (plain[1], plain[2]))),  # the plain output of prompt 1 as bad words
        dict(bias={9: 100.0}),  # forces token 9
    ]
    params = [greedy(logit_bias=c.get("bias"), allowed_token_ids=c.get("allowed"),
                     bad_words=[" ".join(f"w{t}" for t in seq) for seq in c["bad"]] if "bad" in c else None)
              for c in cases]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, c, o in zip(prompts, cases, outs):
        ref, margins = reference(hf, p, N, **c)
        assert_greedy_match(list(o.outputs[0].token_ids), ref, margins, f"{c}")
    assert list(outs[4].outputs[0].token_ids) == [9] * N
    assert set(outs[2].outputs[0].token_ids) <= {10, 11, 12, 13, 200, 300}
    # Bad words: the banned word never appears, nor the two-token sequence.
    toks = list(outs[3].outputs[0].token_ids)
    assert plain[0] not in toks and not any(toks[i:i + 2] == plain[1:3] for i in range(N - 1))
    # The same prompt without controls, alone: the batch's controls did not leak into it.
    alone = llm.generate({"prompt_token_ids": prompts[1]}, greedy(), use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_sampled_request_keeps_to_allowed_tokens(llm):
    allowed = [3, 50, 51, 52, 400]
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, allowed_token_ids=allowed, logprobs=3)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, p, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    for lp in out.logprobs:  # the top logprobs are over the allowed tokens only
        assert set(lp) <= set(allowed)


def test_no_compiles_after_warmup(llm):
    with count_compiles(llm.llm_engine.model_runner) as compiled:
        llm.generate([{"prompt_token_ids": [5, 6, 7, i]} for i in range(4)],
                     [greedy(logit_bias={7: 3.0}), greedy(allowed_token_ids=[5, 6]), greedy(bad_words=["w9 w10"]),
                      SamplingParams(max_tokens=4, temperature=0.8, seed=1, logit_bias={3: -100})], use_tqdm=False)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"


def test_bad_words_tokenized_as_written(llm):
    ip = llm.llm_engine.input_processor
    assert ip.bad_words_token_ids(["w9 w10", " w11"]) == ((9, 10), (11,))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [5]}, greedy(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_speculative_decoding_keeps_the_controls(llm, model):
    """n-gram drafts verified under logit_bias and allowed_token_ids give the tokens
    decoding without drafts gives (repetitive prompts, so drafts are proposed)."""
    spec = LLM(str(model), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=8 << 20,
               compilation_cache=False, progress=False, dtype="float32",
               # Every draft verified: the adaptive budget keeps drafts by measured step
               # times, and on a loaded CI machine it kept none (a flake at 22c337d).
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2, "adaptive_drafts": False})
    prompts = [{"prompt_token_ids": [10, 11, 12, 10, 11, 12, 10, 11]}, {"prompt_token_ids": [20, 21, 20, 21, 20]}]
    params = [greedy(allowed_token_ids=[10, 11, 12, 13]), greedy(logit_bias={21: 4.0, 20: 4.0})]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.get_metrics()["spec_decode"]["num_draft_tokens"] > 0
