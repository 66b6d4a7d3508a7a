"""Grammar-constrained decoding end to end on a tiny random Llama with a byte-level
BPE tokenizer (issue 11). The model's output is noise, so the constraint does all the
work: every constrained output must parse and validate."""
import json
import re

import jsonschema
import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMAS = [
    {  # nested objects, arrays, enums, bounded numbers
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 6},
                "level": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["name", "level"], "additionalProperties": False},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": -20, "maximum": 300},
                       "minItems": 1, "maxItems": 3},
            "mode": {"enum": ["fast", "slow", "off"]},
        },
        "required": ["user", "scores", "mode"], "additionalProperties": False,
    },
    {  # booleans, null, an array of objects. (No unbounded "number": a random model may
       # write fraction digits until max_tokens, and that is the model, not the grammar.)
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "pct": {"type": "integer", "minimum": 0, "maximum": 100},
            "items": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "tag": {"enum": ["a", "b", None]}},
                "required": ["id", "tag"], "additionalProperties": False}},
        },
        "required": ["ok", "pct", "items"], "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 4},
]


def _llm(path, backend):
    return LLM(str(path), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128, kv_cache_memory=16 << 20,
               progress=False, structured_outputs_backend=backend)


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return tiny_models("llama", tokenizer="bytes")


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def llm(request, model_path):
    return _llm(model_path, request.param)


def _json_params(schema, i, **kw):
    # Greedy for every fourth request, seeded sampling for the rest. Compact JSON: a
    # random model would otherwise emit optional whitespace without end.
    return SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, seed=i, max_tokens=300,
                          structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True), **kw)


def test_json_schema_outputs_validate(llm):
    """25 per backend (50 in all): every output parses and validates against its schema."""
    prompts = [f"record {i}:" for i in range(25)]
    params = [_json_params(SCHEMAS[i % len(SCHEMAS)], i) for i in range(25)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[i % len(SCHEMAS)])


def test_regex_choice_and_grammar(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( ok)?"
    choices = ["yes", "no", "maybe later"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    cases = []
    for i in range(6):
        cases += [(StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
                  (StructuredOutputsParams(choice=choices), lambda t: t in choices),
                  (StructuredOutputsParams(grammar=grammar), lambda t: re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9]))*\)", t))]
    params = [SamplingParams(temperature=0.0 if i < 3 else 1.0, seed=i, max_tokens=60, structured_outputs=so)
              for i, (so, _) in enumerate(cases)]
    outs = llm.generate([f"q{i}" for i in range(len(cases))], params, use_tqdm=False)
    for (so, check), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop" and check(text), (so.kind, text)


def test_json_object_and_logprobs_of_masked_tokens(llm):
    """json_object: an object; logprobs come from the masked logits (a forbidden token is never listed)."""
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=200, logprobs=3,
                        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    out = llm.generate(["obj"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")
    first = out.logprobs[0]
    # The first token must open the object: every finite-logprob candidate starts with "{".
    tok = llm.get_tokenizer()
    for tid, lp in first.items():
        if np.isfinite(lp.logprob):
            assert tok.decode([tid]).startswith("{"), (tid, tok.decode([tid]), lp)


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    """A batch mixing constrained and free requests gives the free ones the tokens they get alone."""
    free = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=7, max_tokens=12)]
    prompts = ["alpha beta", "gamma"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed_params = [free[0], _json_params(SCHEMAS[0], 1), free[1], _json_params(SCHEMAS[2], 2)]
    mixed = llm.generate([prompts[0], "c1", prompts[1], "c2"], mixed_params, use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_no_compiles_after_warmup_with_constraints(llm):
    with count_compiles(llm.llm_engine.model_runner) as compiled:
        params = [_json_params(SCHEMAS[i % 3], i, logprobs=2 if i % 2 else None) for i in range(5)]
        params += [SamplingParams(temperature=0.7, seed=1, max_tokens=5, presence_penalty=0.5)]
        llm.generate([f"p{i}" for i in range(6)], params, use_tqdm=False)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"


@pytest.mark.parametrize("so, field", [
    (dict(json='{"type": "object", "properties": '), "structured_outputs.json"),
    (dict(json={"type": "no-such-type"}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_value_errors(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_data_parallel_ranks_get_their_own_masks(model_path):
    """dp=2: each rank's constrained rows get their masks (the scatter honours the rank offsets)."""
    llm = LLM(str(model_path), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=8 << 20,
              progress=False, data_parallel_size=2, enforce_eager=True)
    constrained = [i % 4 in (1, 2) for i in range(8)]  # the balancer alternates ranks: both get some
    params = [_json_params(SCHEMAS[i % 3], i) if c else SamplingParams(temperature=0.0, max_tokens=6)
              for i, c in enumerate(constrained)]
    masked = [set(), set()]  # per rank: the requests that got a mask
    for rank, sched in enumerate(llm.llm_engine.engine_core.schedulers):
        def spy(counts, _orig=sched._grammar_bitmask, _rank=rank):
            ids, bitmask = _orig(counts)
            masked[_rank].update(ids)
            return ids, bitmask
        sched._grammar_bitmask = spy
    outs = llm.generate([f"r{i}" for i in range(8)], params, use_tqdm=False)
    assert masked[0] and masked[1], masked
    for i, out in enumerate(outs):
        if constrained[i]:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[i % 3])
