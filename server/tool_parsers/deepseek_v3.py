"""DeepSeek-V3 / R1 tool calls (vLLM's ``deepseek_v3``), and V3.1's shorter form
(``deepseek_v31``); one parser reads both::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                          (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                                                                       (V3.1)

Text before the calls is content, and so is text after ``<｜tool▁calls▁end｜>``. Each
call is sent when its ``<｜tool▁call▁end｜>`` arrives (or the output ends right after
its arguments). A call that is not a name and a JSON object, and what follows it, is
content.
"""
from __future__ import annotations

from server.tool_parsers.base import ToolParser, ToolStreamer, json_object, partial_prefix_len

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


def parse_call(text: str) -> tuple[str, dict] | None:
    """One call's text (between the begin and end markers) -> (name, arguments)."""
    kind, sep, rest = text.partition(SEP)
    if not sep:
        return None
    kind = kind.strip()
    if kind == "function" and "\n" in rest.strip():  # V3: the name, then a fenced JSON block
        name, _, body = rest.strip().partition("\n")
    else:  # V3.1: the name before the separator
        name, body = kind, rest
    body = body.strip()
    if body.startswith("```"):
        body = body.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    name = name.strip()
    args = json_object(body)
    if not name or any(c in name for c in " \n\"'{}") or args is None:
        return None
    return name, args


class DeepSeekV3ToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # "text" | "calls" | "call" | "after"
        self._raw = ""  # the markers consumed since the last call (content again if the next fails)

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "text":
                i = self._buf.find(CALLS_BEGIN)
                if i < 0:
                    hold = 0 if final else partial_prefix_len(self._buf, (CALLS_BEGIN,))
                    self._content(self._buf[: len(self._buf) - hold])
                    self._buf = self._buf[len(self._buf) - hold:]
                    return
                self._content(self._buf[:i])
                self._buf, self._raw, self._state = self._buf[i + len(CALLS_BEGIN):], CALLS_BEGIN, "calls"
            elif self._state == "calls":
                stripped = self._buf.lstrip()
                self._raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if not stripped:
                    return
                if stripped.startswith(CALL_BEGIN):
                    self._buf, self._raw, self._state = stripped[len(CALL_BEGIN):], self._raw + CALL_BEGIN, "call"
                elif stripped.startswith(CALLS_END):
                    self._buf, self._raw, self._state = stripped[len(CALLS_END):], "", "after"
                elif (CALL_BEGIN.startswith(stripped) or CALLS_END.startswith(stripped)) and not final:
                    return
                else:
                    self._malformed()
            elif self._state == "call":
                i = self._buf.find(CALL_END)
                if i < 0 and not final:
                    return
                body = self._buf if i < 0 else self._buf[:i]
                if i < 0:  # the output ended after the arguments (the end markers are stop tokens)
                    body = body.removesuffix(CALLS_END)
                parsed = parse_call(body)
                if parsed is None:
                    self._malformed()
                    return
                self._send_call(*parsed)
                self._buf = "" if i < 0 else self._buf[i + len(CALL_END):]
                self._raw, self._state = "", "calls"
            else:  # after the calls: content
                self._content(self._buf)
                self._buf = ""
        if final and not self._passthrough and self._state == "calls" and not self.successful_calls():
            self._malformed()  # a begin marker and nothing else
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""

    def _malformed(self) -> None:
        self._passthrough = True
        self._content(self._raw + self._buf)
        self._raw, self._buf = "", ""


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    streamer_class = DeepSeekV3ToolStreamer

    def skip_special_tokens(self, skip: bool) -> bool:
        return False  # the markers are added tokens of DeepSeek's tokenizer
