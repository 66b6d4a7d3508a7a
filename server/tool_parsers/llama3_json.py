"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's ``llama3_json`` parser)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is tool calls when it starts (after whitespace) with ``<|python_tag|>`` or
``{``: JSON objects with "name" and "parameters" (or "arguments"), separated by ``;``
(or just whitespace). Anything else is plain content; text after the calls is content.
"""
from __future__ import annotations

from server.tool_parsers.base import ToolParser, ToolStreamer

BOT = "<|python_tag|>"


class Llama3JsonToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "call" | "between"

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state in ("start", "between"):
                stripped = self._buf.lstrip()
                if self._state == "start":
                    self._content(self._buf[: len(self._buf) - len(stripped)])  # held: trailing whitespace
                if not stripped:
                    self._buf = ""
                    return
                if self._state == "between" and stripped[0] == ";":
                    self._buf = stripped[1:]
                    continue
                if stripped.startswith(BOT):
                    self._buf = stripped[len(BOT):]
                    self._start_call(BOT)
                elif stripped[0] == "{":
                    self._buf = stripped
                    self._start_call("")
                elif BOT.startswith(stripped) and not final:
                    self._buf = stripped
                    return
                else:  # not a call: the rest is content
                    self._buf = stripped
                    self._passthrough = True
                    break
                self._state = "call"
            else:
                if not self._scan():
                    return
                self._state = "between"
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    streamer_class = Llama3JsonToolStreamer
