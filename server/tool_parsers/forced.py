"""The outputs of constrained tool choices (no model-specific format involved).

tool_choice="required": the output is a JSON array of ``{"name", "parameters"}``
objects (the schema from ``server.structured.tool_call_array_schema``); each becomes a
call whose arguments are the parameters (canonical JSON).

tool_choice={"type": "function", "function": {"name": f}}: the whole output is the
arguments of one call to f, passed on as the model wrote them (as vLLM does).
"""
from __future__ import annotations

from server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolDelta,
    ToolStreamer,
    make_tool_call_id,
    tool_call,
)


class JsonArrayToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "item" | "call" | "sep" | "end"

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "call":
                if not self._scan():
                    return
                self._state = "sep"
                continue
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                return
            ch = stripped[0]
            self._buf = stripped
            if self._state == "start" and ch == "[":
                self._buf = stripped[1:]
                self._state = "item"
            elif self._state == "item" and ch == "{":
                self._start_call("")
                self._state = "call"
            elif self._state == "sep" and ch in ",]":
                self._buf = stripped[1:]
                self._state = "item" if ch == "," else "end"
            else:  # not the expected array: the rest is content
                self._passthrough = True
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""


class NamedToolStreamer:
    """The output is the arguments of one call to ``name``; the call's header goes out
    with the first text."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = make_tool_call_id()
        self.arguments = ""
        self._header_sent = False

    def feed(self, delta: str, *, final: bool = False) -> ToolDelta:
        self.arguments += delta or ""
        if not delta and not (final and not self._header_sent):
            return ToolDelta()
        entry = {"index": 0, "function": {"arguments": delta or ""}}
        if not self._header_sent:
            self._header_sent = True
            entry = {"index": 0, "id": self.id, "type": "function",
                     "function": {"name": self.name, "arguments": delta or ""}}
        return ToolDelta(tool_calls=[entry])

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(True, [tool_call(self.name, text or "", self.id)], None)
