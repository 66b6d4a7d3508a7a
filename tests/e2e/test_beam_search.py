"""Beam search (jaxserve/beam_search.py) against HF's num_beams on a tiny random Llama
(float32): every returned beam equal, offline and through the server's
use_beam_search; the search's bookkeeping (EOS, length penalty, max_model_len) on
scripted logprobs."""
import math

import httpx
import pytest
import torch
import transformers

from jaxserve import LLM
from jaxserve.beam_search import BeamSearch, BeamSearchParams, beam_score

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8], [40, 41, 300]]


def hf_beams(path, prompt, width, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=n, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                          early_stopping=False)
    return [x[len(prompt):].tolist() for x in out]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


def test_beams_equal_hf(model):
    llm = LLM(str(model), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=8 << 20,
              compilation_cache=False, progress=False, dtype="float32")
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        assert [s.output_token_ids for s in result.sequences] == hf_beams(model, prompt, 4, 10)
        best = result.sequences[0]
        assert best.tokens[:len(prompt)] == prompt and best.finish_reason == "length"
        assert math.isclose(best.cum_logprob, sum(next(iter(d.values())) for d in best.logprobs), rel_tol=1e-6)
        assert best.text == llm.tokenizer.decode(best.tokens, skip_special_tokens=True)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search("w5", BeamSearchParams(beam_width=11, max_tokens=2))


def test_use_beam_search_over_http(model):
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from server.app import build_app
    from tests.server.harness import RunningServer

    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model), max_model_len=128, max_num_seqs=8,
                                                  max_num_batched_tokens=64, kv_cache_memory=8 << 20,
                                                  dtype="float32"), progress=False)
    srv = RunningServer(build_app(engine, "tiny"))
    try:
        tok = transformers.AutoTokenizer.from_pretrained(model)
        prompt = " ".join(f"w{t}" for t in PROMPTS[0])
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "n": 3, "use_beam_search": True,
                "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
        want = [tok.decode(b) for b in hf_beams(model, PROMPTS[0], 3, 8)]
        assert [c["text"] for c in r["choices"]] == want and r["usage"]["completion_tokens"] == 24
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "n": 2,
            "use_beam_search": True, "ignore_eos": True}).json()
        assert len(chat["choices"]) == 2 and chat["choices"][0]["message"]["content"]
        bad = httpx.post(f"{srv.url}/v1/completions", json=body | {"stream": True}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
    finally:
        srv.stop()
        engine.shutdown()


def test_search_bookkeeping_on_scripted_logprobs():
    """EOS ends a beam (kept aside, ranked at the end); the length penalty ranks the
    finished and live beams; max_model_len ends a beam by length."""
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0), eos_token_id=0)
    search.advance([{0: -0.1, 5: -0.5, 6: -2.0, 7: -3.0}])  # EOS is the best first token
    assert [s.tokens for s in search.finished[0]] == [[1, 2, 0]] and [s.tokens[-1] for s in search.live[0]] == [5, 6]
    search.advance([{8: -0.1, 9: -0.2, 0: -5, 3: -6}, {8: -0.3, 9: -0.4, 0: -5, 3: -6}])
    assert [s.tokens[2:] for s in search.live[0]] == [[5, 8], [5, 9]]
    search.advance([{8: -0.1, 9: -0.2, 0: -5, 3: -6}, {8: -0.3, 9: -0.4, 0: -5, 3: -6}])
    assert search.done
    best = search.results()[0].sequences
    # [1, 2, 0]: -0.1 over 2 tokens (EOS not counted) beats -0.7 over 5.
    assert best[0].tokens == [1, 2, 0] and best[0].finish_reason == "stop"
    assert beam_score(best[0], 0, 1.0) == pytest.approx(-0.05)
    assert best[1].finish_reason == "length" and best[1].tokens == [1, 2, 5, 8, 8]
    capped = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), eos_token_id=0)
    capped.advance([{4: -0.1, 3: -0.2}], max_len=3)
    assert capped.done and capped.results()[0].sequences[0].finish_reason == "length"
