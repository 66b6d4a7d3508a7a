"""xgrammar (MLC): pushdown automaton with precomputed token masks per grammar state.

Needs torch at import (xgrammar imports it for its own mask kernels; we only use
its CPU matcher, writing into numpy through DLPack), so it is an optional extra:
``pip install jaxserve[xgrammar]``. Compiled grammars are cached by xgrammar's
GrammarCompiler (keyed by the grammar text)."""
from __future__ import annotations

import json
import re
import threading

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.backend_types import (
    MAX_JSON_WHITESPACE,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    invalid,
    schema_text,
)


def is_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:  # noqa: BLE001 — ImportError, or torch missing underneath
        return False
    return True


def _grammar(params: StructuredOutputsParams):
    """params -> an xgrammar Grammar (parsing only: no tokenizer). Raises ValueError."""
    import xgrammar as xgr

    kind = params.kind
    try:
        # (xgrammar has no whitespace pattern: a custom one is honoured by llguidance only.)
        ws = dict(any_whitespace=not params.disable_any_whitespace,
                  max_whitespace_cnt=None if params.disable_any_whitespace else MAX_JSON_WHITESPACE)
        if kind == "json":
            schema = _bounded_strings_as_patterns(json.loads(schema_text(params)))
            return xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=params.disable_additional_properties,
                                                **ws)
        if kind == "json_object":  # an object (OpenAI's json_object), not any JSON value
            return xgr.Grammar.from_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # A regex of the escaped alternatives (xgrammar has no choice form).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise invalid(params, _clean(str(e)) or repr(e)) from None


def _clean(message: str) -> str:
    """xgrammar's C++ messages without the log prefix ('[hh:mm:ss] file.cc:123: Check failed: ...: ')."""
    text = message.strip().splitlines()[0] if message.strip() else ""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _bounded_strings_as_patterns(schema):
    """String schemas with minLength / maxLength -> the same bounds as a pattern.

    xgrammar 0.2.9 spells a length-bounded string as [^"\\\r\n]{m,n}, which admits raw
    control characters: invalid JSON (found by tests/e2e/test_structured_outputs.py).
    Its pattern strings exclude them. Escapes are not allowed either way."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (lo, "" if hi is None else int(hi))
    return out


def supports(params: StructuredOutputsParams) -> bool:
    """Whether xgrammar accepts this constraint (auto falls back to llguidance if not)."""
    try:
        _grammar(params)
    except ValueError:
        return False
    return True


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return False
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def compiler(self):
        """Built on first use (the tokenizer's vocabulary is analysed once, ~1 s)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            return self._compiler

    def validate(self, params: StructuredOutputsParams) -> None:
        _grammar(params)

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        import xgrammar as xgr

        compiled = self.compiler.compile_grammar(_grammar(params))
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
