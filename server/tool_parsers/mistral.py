"""Mistral tool calls (vLLM's ``mistral`` parser), both of Mistral's formats::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]ping{}        (tokenizer v11+)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                      (v13, with [ARGS])

Text before the first ``[TOOL_CALLS]`` is content. The array form streams each call's
arguments as they are written; the name-then-arguments form sends each call when its
arguments object closes. A malformed call, and what follows, is content.
"""
from __future__ import annotations

from server.tool_parsers.base import ToolParser, ToolStreamer, json_object, partial_prefix_len

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


def balanced_end(text: str, opener: str, closer: str) -> int:
    """Index just past the bracket that closes ``text[0]`` (== ``opener``), skipping
    JSON / Python strings; -1 when it is not closed yet."""
    depth, quote, escaped = 0, None, False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == opener:
            depth += 1
        elif ch == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


class MistralToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        # "text" | "after_bot" | "item" | "call" | "sep" | "name" | "args" | "between"
        self._state = "text"
        self._name = ""
        self._raw_name = ""  # the name as written (with [ARGS]): content again if the call fails
        self._raw = ""  # markers and separators consumed since the last call: content again if the next fails

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "text":
                i = self._buf.find(BOT)
                if i < 0:
                    hold = 0 if final else partial_prefix_len(self._buf, (BOT,))
                    self._content(self._buf[: len(self._buf) - hold])
                    self._buf = self._buf[len(self._buf) - hold:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(BOT):]
                self._raw, self._state = BOT, "after_bot"
            elif self._state == "call":
                if not self._scan():
                    return
                self._state = "sep"
            elif self._state == "args":
                end = balanced_end(self._buf, "{", "}")
                if end < 0:
                    if final:
                        self._malformed(self._raw_name + self._buf)
                    return
                self._emit_whole(self._name, self._raw_name, self._buf[:end])
                if self._passthrough:
                    return
                self._buf, self._raw = self._buf[end:], ""
                self._state = "between"
            elif self._state == "name":
                j = self._buf.find("{")
                if j < 0:
                    if final or len(self._buf) > 256:
                        self._malformed(self._buf)
                    return
                name = self._buf[:j].removesuffix(ARGS).strip()
                if not name or any(c in name for c in " \n\"'[]{}"):
                    self._malformed(self._buf)
                    return
                self._name, self._raw_name, self._buf, self._state = name, self._buf[:j], self._buf[j:], "args"
            else:
                stripped = self._buf.lstrip()
                self._raw += self._buf[: len(self._buf) - len(stripped)]
                if not stripped:
                    self._buf = ""
                    return
                self._buf, ch = stripped, stripped[0]
                if self._state == "after_bot":
                    if ch == "[":  # the JSON array form
                        self._buf, self._raw, self._state = stripped[1:], self._raw + "[", "item"
                    else:
                        self._state = "name"
                elif self._state == "item" and ch == "{":
                    self._start_call(self._raw)
                    self._raw, self._state = "", "call"
                elif self._state == "sep" and ch in ",]":
                    self._buf, self._raw = stripped[1:], ch
                    self._state = "item" if ch == "," else "between"
                elif self._state == "between" and stripped.startswith(BOT):
                    self._buf, self._raw, self._state = stripped[len(BOT):], self._raw + BOT, "after_bot"
                elif self._state == "between" and BOT.startswith(stripped) and not final:
                    return
                else:  # text after the calls (or a broken array): content
                    self._passthrough = True
        if final and not self._passthrough and self._state in ("after_bot", "name", "item"):
            self._malformed(self._buf)  # the output ended before a call did
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""

    def _emit_whole(self, name: str, raw_name: str, arguments: str) -> None:
        """A call of the name-then-arguments form, sent whole (canonical JSON arguments)."""
        args = json_object(arguments)
        if args is None:
            self._malformed(raw_name + arguments + self._buf[len(arguments):])
            return
        self._send_call(name, args)

    def _malformed(self, raw: str) -> None:
        """Not a call: what was consumed for it, and the rest, are content."""
        self._passthrough = True
        self._content(self._raw + raw)
        self._raw, self._buf = "", ""


class MistralToolParser(ToolParser):
    name = "mistral"
    streamer_class = MistralToolStreamer

    def skip_special_tokens(self, skip: bool) -> bool:
        return False  # [TOOL_CALLS] and [ARGS] are special tokens
