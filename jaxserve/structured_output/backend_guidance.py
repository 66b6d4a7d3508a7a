"""llguidance (guidance-ai): Earley parser over a lazily built token trie; no torch.

Grammars are llguidance's own JSON form, built from the request by llguidance's
converters (JSON schema, regex, Lark / GBNF). A compiled matcher is cached per
grammar text and deep-copied for each request (copying is far cheaper than
building)."""
from __future__ import annotations

import json
import threading
from functools import lru_cache

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.backend_types import (
    MAX_JSON_WHITESPACE,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    invalid,
    schema_text,
)


def grammar_spec(params: StructuredOutputsParams) -> str:
    """params -> an llguidance grammar (text). Raises ValueError for a malformed one."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        # The request's settings override the schema's own "x-guidance"; the bounded
        # default whitespace only fills in.
        defaults = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
        options: dict = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        elif params.whitespace_pattern:
            options["whitespace_pattern"] = params.whitespace_pattern
        schema = schema_text(params) if kind == "json" else '{"type": "object"}'
        if params.disable_additional_properties and kind == "json":
            schema = json.dumps(_no_additional_properties(json.loads(schema)))
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=options or None)
        except ValueError as e:
            raise invalid(params, str(e)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise invalid(params, str(e)) from None


def _no_additional_properties(schema):
    """Every object schema that leaves additionalProperties open gets it set to false."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if self.matcher.is_stopped():
                return False  # nothing may follow a finished grammar (the stop token is not consumed)
            if not self.matcher.consume_token(t):
                return False
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        """Built on first use (~1 s for a 50k vocabulary), off the engine loop."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def validate(self, params: StructuredOutputsParams) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar_spec(params), None)
        if error:
            raise invalid(params, error)

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        return GuidanceGrammar(self._pristine(grammar_spec(params)).deep_copy())

    @lru_cache(maxsize=256)  # noqa: B019 — one backend per engine, lives as long as it
    def _pristine(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher
