"""Hermes / Qwen2.5 / Qwen3 tool calls (vLLM's ``hermes`` parser)::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of calls; text outside them is the message content. A closing tag may be
missing (the model stopped after the JSON). A call whose JSON is malformed, and the
text after it, are returned as content.
"""
from __future__ import annotations

from server.tool_parsers.base import ToolParser, ToolStreamer, partial_prefix_len

START, END = "<tool_call>", "</tool_call>"


class HermesToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # "text" | "call" | "after_call"

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "text":
                i = self._buf.find(START)
                if i < 0:
                    hold = 0 if final else partial_prefix_len(self._buf, (START,))
                    self._content(self._buf[: len(self._buf) - hold])
                    self._buf = self._buf[len(self._buf) - hold:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(START):]
                self._start_call(START)
                self._state = "call"
            elif self._state == "call":
                if not self._scan():
                    return
                self._state = "after_call"
            else:  # after a call: whitespace, then (optionally) the closing tag
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    return
                if stripped.startswith(END):
                    self._buf = stripped[len(END):]
                elif END.startswith(stripped) and not final:
                    self._buf = stripped
                    return
                else:
                    self._buf = stripped
                self._state = "text"
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""


class HermesToolParser(ToolParser):
    name = "hermes"
    streamer_class = HermesToolStreamer

    def skip_special_tokens(self, skip: bool) -> bool:
        # <tool_call> is a special token in some tokenizers (vLLM keeps them too).
        return False
