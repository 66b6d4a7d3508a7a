"""GPT-OSS function calls in OpenAI's harmony format (vLLM's ``openai`` parser)::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Reads the raw harmony output, or what the ``gpt_oss`` reasoning parser leaves as
content (the same blocks, canonical). Each message addressed to ``functions.NAME`` is a
call, sent whole when it ends (``<|call|>``, the next message, or the end of the output:
``<|call|>`` is a stop token); its arguments are canonical JSON when they parse, else
the model's text. The contents of the other messages (final, preambles, and analysis
when no reasoning parser took it) are the content, in order.
"""
from __future__ import annotations

import json

from jaxserve.reasoning import harmony
from server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    ToolStreamer,
    json_object,
    partial_prefix_len,
    tool_call,
)


class OpenAIToolStreamer(ToolStreamer):
    """Re-reads the whole text on each delta (harmony.parse_messages is monotone)."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._content_sent = 0  # characters of the joined content already released
        self._calls_sent = 0  # call messages already sent

    def _step(self, final: bool) -> None:
        self._text += self._buf
        self._buf = ""
        hold = 0 if final else partial_prefix_len(self._text, harmony.TAGS)
        messages = harmony.parse_messages(self._text[: len(self._text) - hold])
        content, calls = [], []
        for k, msg in enumerate(messages):
            if not msg.header_done:
                if final:  # the output ended inside a header: its text is content
                    content.append(msg.header)
            elif msg.function is not None:
                if msg.terminator is not None or k < len(messages) - 1 or final:
                    calls.append(msg)
            else:
                content.append(msg.content)
        joined = "".join(content)
        self._content(joined[self._content_sent:])
        self._content_sent = len(joined)
        for msg in calls[self._calls_sent:]:
            args = json_object(msg.content.strip())
            self._open_call(msg.function)
            self._send_arguments(json.dumps(args, ensure_ascii=False) if args is not None else msg.content.strip(),
                                 complete=True)
        self._calls_sent = len(calls)

    def extract(self, text: str) -> ExtractedToolCalls:
        # The content is the messages' text, not the raw harmony output, with or without calls.
        out = self.feed(text, final=True)
        calls = [tool_call(c.name, c.arguments, c.id) for c in self.successful_calls()]
        return ExtractedToolCalls(bool(calls), calls, out.content or None)


class OpenAIToolParser(ToolParser):
    name = "openai"
    streamer_class = OpenAIToolStreamer

    def skip_special_tokens(self, skip: bool) -> bool:
        return False  # harmony's structure is in its special tokens
