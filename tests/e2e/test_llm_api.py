"""The offline LLM API end to end on a tiny random Llama (word-level tokenizer:
token i decodes to the word "w{i}", words joined by spaces)."""
import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams

@pytest.fixture(scope="module")
def llm(tiny_models):
    path = tiny_models("llama", kv_heads=2)
    # Warm-up on: this instance checks that serving compiles nothing.
    return LLM(str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
               compilation_cache=False, progress=False, token_buckets=None,
               # Defaults for calls without sampling_params (test_generation_config_defaults);
               # every other test passes its own.
               override_generation_config={"temperature": 0.0, "max_new_tokens": 5})


def ids(seed, n):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def gen(llm, prompts, **kw):
    kw.setdefault("max_tokens", 8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw), use_tqdm=False)
    return outs


def test_no_compilation_after_warmup(llm):  # JX-01
    rng = np.random.default_rng(0)
    with count_compiles(llm.llm_engine.model_runner) as compiled:
        for batch in ([5], [1, 60, 7], [30] * 8, [100, 3], [64, 2, 2, 9, 17]):
            sps = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])),
                                  top_p=float(rng.choice([1.0, 0.9])), max_tokens=int(rng.integers(1, 12)),
                                  presence_penalty=float(rng.choice([0.0, 0.5])), logprobs=int(rng.choice([0, 3])),
                                  prompt_logprobs=None if rng.random() < 0.7 else 2, seed=int(rng.integers(100)))
                   for _ in batch]
            llm.generate([{"prompt_token_ids": ids(n, n)} for n in batch], sps, use_tqdm=False)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"


def test_one_token_steps_run_in_their_own_bucket(llm):
    """On a CPU the default token buckets are every power of two from 1 (a one-token
    step's matmuls are then matrix-vector products; small GEMMs cost by the row): a
    three-token prefill runs the four-token program, a lone decode row the one-token
    program, its sampler the one-request one."""
    runner = llm.llm_engine.model_runner
    assert runner.token_buckets.buckets[:5] == (1, 2, 4, 8, 16) and runner.request_buckets.buckets[:2] == (1, 8)
    keys = []
    real = runner._run
    runner._run = lambda key, *a: keys.append(key) or real(key, *a)
    try:
        gen(llm, [ids(7, 3)], max_tokens=3, temperature=0.0, ignore_eos=True)
    finally:
        runner._run = real
    steps = [k.num_tokens for k in keys if hasattr(k, "num_tokens")]
    samplers = [k.num_reqs for k in keys if hasattr(k, "num_reqs")]
    assert steps == [4, 1, 1] and samplers == [1, 1, 1], keys  # the prefill, then two decodes


def test_results_in_input_order_and_lengths(llm):  # EN-06
    ps = [ids(i, 3 + 7 * i) for i in range(6)]
    outs = gen(llm, ps, temperature=0.0, ignore_eos=True, max_tokens=5)
    assert [o.prompt_token_ids for o in outs] == ps
    assert all(len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length" for o in outs)
    # Text is decoded in the prompt's context (as vLLM does): decode(prompt + output) - decode(prompt).
    tok = llm.get_tokenizer()
    full = tok.decode(ps[0] + outs[0].outputs[0].token_ids)
    assert outs[0].outputs[0].text == full[len(tok.decode(ps[0])):]


def test_n_and_seeds(llm):  # SA-12, SA-13
    p = ids(1, 10)
    outs = gen(llm, [p], n=3, temperature=1.5, seed=5, ignore_eos=True)
    comps = outs[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in comps}) == 3
    again = gen(llm, [ids(9, 40), p, p], temperature=1.5, seed=5, ignore_eos=True)
    assert again[1].outputs[0].token_ids == again[2].outputs[0].token_ids == comps[0].token_ids
    other = gen(llm, [p], temperature=1.5, seed=6, ignore_eos=True)
    assert other[0].outputs[0].token_ids != comps[0].token_ids


def test_stop_strings_on_text(llm):  # OP-03, OP-04
    base = gen(llm, [ids(2, 12)], temperature=0.0, ignore_eos=True, max_tokens=8)[0].outputs[0]
    words = base.text.lstrip(" ").split(" ")
    assert len(words) == 8 and base.text == " " + " ".join(words)
    # A stop string spanning two tokens, ending inside the second one.
    stop = f"{words[2][1:]} {words[3][:2]}"
    cut = gen(llm, [ids(2, 12)], temperature=0.0, ignore_eos=True, max_tokens=8, stop=[stop, "zzz"])[0].outputs[0]
    full_prefix = " " + " ".join(words[:4])
    idx = full_prefix.find(stop)
    assert cut.text == full_prefix[:idx] and cut.finish_reason == "stop" and cut.stop_reason == stop
    inc = gen(llm, [ids(2, 12)], temperature=0.0, ignore_eos=True, max_tokens=8, stop=[stop],
              include_stop_str_in_output=True)[0].outputs[0]
    assert inc.text == full_prefix[: idx + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):  # OP-05, SC-07, SA-16
    base = gen(llm, [ids(3, 9)], temperature=0.0, ignore_eos=True, max_tokens=8)[0].outputs[0]
    stop_tok = base.token_ids[3]
    out = gen(llm, [ids(3, 9)], temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok])[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert f"w{stop_tok}" not in out.text.split(" ")[first + 1 :]
    assert out.text.split(" ")[-1] != f"w{stop_tok}"
    held = gen(llm, [ids(3, 9)], temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok], min_tokens=8)[0]
    assert len(held.outputs[0].token_ids) == 8 and stop_tok not in held.outputs[0].token_ids
    # min_tokens can hold back at most 16 stop ids (EOS included); without it, any number stop.
    many = list(range(100, 117))
    with pytest.raises(ValueError, match="stop_token_ids: at most 16 stop token ids"):
        gen(llm, [ids(3, 9)], stop_token_ids=many, min_tokens=2)
    assert gen(llm, [ids(3, 9)], temperature=0.0, max_tokens=2, stop_token_ids=many)[0].finished


def test_context_length_boundaries(llm):  # CL-01, CL-03, CL-04
    out = gen(llm, [ids(4, 127)], temperature=0.0, max_tokens=5, ignore_eos=True)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = gen(llm, [ids(4, 128)], temperature=0.0, max_tokens=5, ignore_eos=True)[0].outputs[0]
    assert len(out.token_ids) == 1
    with pytest.raises(ValueError, match="maximum model length of 128"):
        gen(llm, [ids(4, 129)])
    with pytest.raises(ValueError, match="cannot be empty"):
        gen(llm, [[]])
    with pytest.raises(ValueError, match="out of vocabulary"):
        gen(llm, [[5, 999999]])
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        gen(llm, [[5, -1]])
    with pytest.raises(ValueError, match="logprobs"):
        gen(llm, [[5, 6]], logprobs=21)
    # Nothing was left behind by the rejected requests.
    assert not llm.llm_engine.has_unfinished_requests()


def test_logprobs_shapes(llm):  # LP-01, LP-02, LP-03
    out = gen(llm, [ids(5, 10)], temperature=1.0, seed=1, max_tokens=6, logprobs=3, ignore_eos=True)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and len(d) in (3, 4)
        assert sorted(lp.rank for t, lp in d.items() if t != tok or lp.rank <= 3)[:3] == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-5)
    none = gen(llm, [ids(5, 10)], max_tokens=2)[0].outputs[0]
    assert none.logprobs is None and none.cumulative_logprob is None


def test_chat_and_text_prompts(llm):
    out = llm.chat([{"role": "user", "content": "w5 w6 w7"}], SamplingParams(temperature=0, max_tokens=3),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    templated = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], tokenize=False,
                                        add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(templated, add_special_tokens=False)
    txt = llm.generate("w10 w11", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert txt.prompt == "w10 w11" and len(txt.outputs[0].token_ids) <= 2


def test_numpy_token_ids_and_request_id_reuse(llm):
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": np.arange(5, 15)}
    engine.add_request("x", prompt, SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompt, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("x", prompt, SamplingParams(max_tokens=2, n=2, temperature=1.0))  # reusable once finished
    assert sorted(engine.engine_request_ids("x")) == ["0_x", "1_x"]
    outs = engine.abort_request("x")
    assert [o.outputs[0].finish_reason for _, o in outs] == ["abort", "abort"]
    assert engine.engine_request_ids("x") == []
    engine.step()  # tells the runner to drop the aborted requests
    assert not engine.has_unfinished_requests()
    # A caller id equal to another request's child id ("0_y" for n=2 "y") is rejected
    # before anything changes; "y" is unharmed.
    engine.add_request("y", prompt, SamplingParams(max_tokens=2, n=2, temperature=1.0, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0_y", prompt, SamplingParams(max_tokens=2))
    done = {}  # streaming kinds report one choice per output (as vLLM)
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == "y"
            done.update({c.index: len(c.token_ids) for c in o.outputs if c.finish_reason is not None})
    assert done == {0: 2, 1: 2}


def test_generation_config_defaults(llm):
    """No sampling_params: the model's generation-config defaults (here overridden to
    greedy, 5 tokens) replace SamplingParams()'s temperature 1 / 16 tokens."""
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.0, 5, 1.0)
    prompt = {"prompt_token_ids": ids(7, 12)}
    plain = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == explicit.token_ids
    assert len(plain.token_ids) == 5 and plain.finish_reason == "length"


def test_cli_generate_uses_the_models_own_context_limit(tiny_models, capsys):
    """No --max-model-len: the model's max_position_embeddings (512 here), not a fixed 2048."""
    from jaxserve.cli import main

    path = tiny_models("llama", kv_heads=2)
    rc = main(["generate", str(path), "--prompt", "w5 w6 w7", "--raw", "--max-tokens", "3",
               "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--kv-cache-memory", str(4 << 20)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert len(out.out.split()) == 3
