"""Incremental JSON for tool calls: a lexer and a validating scanner of one call object
(``{"name": ..., "arguments": {...}}``) that reports the name once it is whole and the
arguments as canonical JSON text while they arrive.

Canonical means ``json.dumps(value, ensure_ascii=False)`` (separators ", " and ": "),
built token by token: the fragments streamed for a call join to exactly what
``json.dumps(json.loads(raw_arguments), ensure_ascii=False)`` gives, whatever the
model's own spacing and however the text was split into deltas. Strings are streamed
as they arrive (json.dumps escapes character by character, so a prefix of a string
serialises to a prefix of the whole); numbers and literals once complete.
"""
from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_PUNCT = frozenset("{}[]:,")
_CANONICAL_PUNCT = {":": ": ", ",": ", "}
ARGUMENT_KEYS = ("arguments", "parameters")


class JsonError(ValueError):
    """The text is not (the start of) valid JSON of the expected shape."""


def canonical_string(raw: str) -> str:
    """A complete JSON string token (quotes included) as json.dumps writes it."""
    return json.dumps(json.loads(raw, strict=False), ensure_ascii=False)


class JsonLexer:
    """Splits JSON text into tokens as it arrives, one character at a time.

    Tokens are (kind, raw): kind is one of ``{}[]:,`` (raw is that character), "str"
    (raw includes the quotes), "num" or "lit". A number ends at the first character
    that cannot continue it, so it is reported with that character. While a string is
    open, ``in_string`` is true and ``string_safe_prefix()`` is its raw text up to the
    last whole character (not inside an escape, not after a lone high surrogate)."""

    def __init__(self) -> None:
        self.mode: str | None = None  # None | "str" | "num" | "lit"
        self.tok = ""
        self._esc = 0  # 0: none, 1: after a backslash, 2..5: reading \\u hex digits
        self._safe = 0  # raw string length up to the last whole character

    @property
    def in_string(self) -> bool:
        return self.mode == "str"

    def string_safe_prefix(self) -> str:
        return self.tok[: self._safe]

    def push(self, ch: str) -> list[tuple[str, str]]:
        mode = self.mode
        if mode == "str":
            self.tok += ch
            if self._esc == 1:
                if ch not in _ESCAPES:
                    raise JsonError(f"invalid escape \\{ch} in a JSON string")
                if ch == "u":
                    self._esc = 2
                else:
                    self._esc = 0
                    self._safe = len(self.tok)
            elif self._esc >= 2:
                if ch not in _HEX:
                    raise JsonError("invalid \\u escape in a JSON string")
                self._esc += 1
                if self._esc == 6:
                    self._esc = 0
                    code = int(self.tok[-4:], 16)
                    if not 0xD800 <= code <= 0xDBFF:  # a high surrogate waits for its pair
                        self._safe = len(self.tok)
            elif ch == "\\":
                self._esc = 1
            elif ch == '"':
                raw, self.tok, self.mode = self.tok, "", None
                return [("str", raw)]
            else:
                self._safe = len(self.tok)
            return []
        if mode == "num":
            if ch in _NUMBER_CHARS:
                self.tok += ch
                return []
            raw, self.tok, self.mode = self.tok, "", None
            if not _NUMBER_RE.match(raw):
                raise JsonError(f"invalid JSON number {raw!r}")
            return [("num", raw), *self.push(ch)]
        if mode == "lit":
            self.tok += ch
            if self.tok in _LITERALS:
                raw, self.tok, self.mode = self.tok, "", None
                return [("lit", raw)]
            if not any(lit.startswith(self.tok) for lit in _LITERALS):
                raise JsonError(f"invalid JSON literal {self.tok!r}")
            return []
        if ch in _WS:
            return []
        if ch in _PUNCT:
            return [(ch, ch)]
        if ch == '"':
            self.mode, self.tok, self._esc, self._safe = "str", '"', 0, 1
            return []
        if ch == "-" or ch.isdigit():
            self.mode, self.tok = "num", ch
            return []
        if ch in "tfn":
            self.mode, self.tok = "lit", ch
            return []
        raise JsonError(f"unexpected character {ch!r} in JSON")


class JsonStructure:
    """A pushdown check that tokens form one JSON value; tracks the depth."""

    def __init__(self) -> None:
        # One [kind, state] per open container; kind "obj" | "arr".
        self.stack: list[list[str]] = []
        self.done = False  # the top-level value is complete

    @property
    def depth(self) -> int:
        return len(self.stack)

    def expecting_value(self) -> bool:
        if not self.stack:
            return not self.done
        kind, state = self.stack[-1]
        return state == "value" or (kind == "arr" and state == "value_or_end")

    def expecting_key(self) -> bool:
        return bool(self.stack) and self.stack[-1][0] == "obj" and self.stack[-1][1] in ("key_or_end", "key")

    def accept(self, kind: str, raw: str) -> None:
        if self.done:
            raise JsonError("text after the end of a JSON value")
        if self.expecting_key():
            if kind == "str":
                self.stack[-1][1] = "colon"
            elif kind == "}" and self.stack[-1][1] == "key_or_end":
                self._close()
            else:
                raise JsonError(f"expected an object key, got {raw!r}")
            return
        if self.expecting_value():
            if kind == "{":
                self.stack.append(["obj", "key_or_end"])
            elif kind == "[":
                self.stack.append(["arr", "value_or_end"])
            elif kind in ("str", "num", "lit"):
                self._value_done()
            elif kind == "]" and self.stack and self.stack[-1] == ["arr", "value_or_end"]:
                self._close()
            else:
                raise JsonError(f"expected a JSON value, got {raw!r}")
            return
        if not self.stack:  # pragma: no cover - done is handled above
            raise JsonError("text after the end of a JSON value")
        ctx = self.stack[-1]
        if ctx[1] == "colon":
            if kind != ":":
                raise JsonError(f"expected ':', got {raw!r}")
            ctx[1] = "value"
        elif ctx[1] == "comma_or_end":
            if kind == ",":
                ctx[1] = "key" if ctx[0] == "obj" else "value"
            elif (kind == "}" and ctx[0] == "obj") or (kind == "]" and ctx[0] == "arr"):
                self._close()
            else:
                raise JsonError(f"expected ',' or the end of the container, got {raw!r}")
        else:  # pragma: no cover
            raise JsonError(f"unexpected {raw!r}")

    def _close(self) -> None:
        self.stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if self.stack:
            self.stack[-1][1] = "comma_or_end"
        else:
            self.done = True


class CallScanner:
    """Scans one tool-call object ``{"name": str, "arguments"|"parameters": value, ...}``
    as it arrives. ``feed`` returns how many characters it used (it stops right after the
    object's closing brace) and the events so far: ("name", name) once the name string is
    whole, ("args", canonical JSON fragment) as the arguments arrive. Raises JsonError for
    text that cannot become such an object. Keys other than name / arguments / parameters
    are checked and ignored; an object without arguments has the arguments ``{}``."""

    def __init__(self) -> None:
        self.lexer = JsonLexer()
        self.structure = JsonStructure()
        self.name: str | None = None
        self.done = False
        self.has_args = False
        self._key: str | None = None  # the key whose value is being read at depth 1
        self._in_args = False  # inside the (first) arguments value
        self._in_name = False
        self._started = False
        self._partial_sent = 0  # canonical chars of the open arguments string already sent

    def feed(self, text: str) -> tuple[int, list[tuple[str, str]]]:
        events: list[tuple[str, str]] = []
        used = 0
        for ch in text:
            used += 1
            for kind, raw in self.lexer.push(ch):
                self._token(kind, raw, events)
                if self.done:
                    return used, events
        if self._in_args and self.lexer.in_string:
            self._partial_string(events)
        return used, events

    def finish(self) -> list[tuple[str, str]]:
        """Events owed at the end of a complete object (arguments ``{}`` when absent)."""
        return [] if self.has_args else [("args", "{}")]

    # ------------------------------------------------------------------ internals
    def _token(self, kind: str, raw: str, events: list) -> None:
        st = self.structure
        if not self._started:
            if kind != "{":
                raise JsonError("a tool call must be a JSON object")
            self._started = True
            st.accept(kind, raw)
            return
        depth_before = st.depth
        at_key = depth_before == 1 and st.expecting_key()
        value_start = depth_before == 1 and st.expecting_value()
        st.accept(kind, raw)
        if at_key:
            if kind == "str":
                self._key = json.loads(raw, strict=False)
            return
        if value_start:
            if self._key == "name":
                if kind != "str":
                    raise JsonError("the tool call's name must be a string")
                if self.name is None:
                    self.name = json.loads(raw, strict=False)
                    events.append(("name", self.name))
                return
            if self._key in ARGUMENT_KEYS and not self.has_args:
                self.has_args = True
                self._in_args = True
        if self._in_args:
            self._emit(kind, raw, events)
            if st.depth == 1:  # the arguments value is complete
                self._in_args = False
        if st.depth == 0:
            if self.name is None:
                raise JsonError("the tool call has no name")
            self.done = True

    def _emit(self, kind: str, raw: str, events: list) -> None:
        if kind == "str":
            text = canonical_string(raw)[self._partial_sent:]
            self._partial_sent = 0
        elif kind == "num":
            text = json.dumps(json.loads(raw))
        else:
            text = _CANONICAL_PUNCT.get(kind, raw)
        if text:
            events.append(("args", text))

    def _partial_string(self, events: list) -> None:
        safe = self.lexer.string_safe_prefix()
        try:
            text = json.dumps(json.loads(safe + '"', strict=False), ensure_ascii=False)[:-1]
        except ValueError as e:  # pragma: no cover - the lexer checked the escapes
            raise JsonError(str(e)) from e
        if len(text) > self._partial_sent:
            events.append(("args", text[self._partial_sent:]))
            self._partial_sent = len(text)
