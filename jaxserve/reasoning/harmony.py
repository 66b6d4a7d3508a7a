"""OpenAI's harmony format (GPT-OSS), read from text decoded with its special tokens::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message is a header (``<|start|>role``, ``<|channel|>name``, an optional ``to=recipient``
and ``<|constrain|>type``) then ``<|message|>`` and its content, ended by ``<|end|>``,
``<|call|>`` or ``<|return|>``, or by the end of the output (``<|call|>`` and
``<|return|>`` are stop tokens, so the output's text stops before them). Text outside
any message (a model that did not follow the format) is kept as a ``plain`` message.

``parse_messages`` is pure and monotone in its input: a longer text gives the same
messages with the last one grown (or new ones after it), provided the text does not end
inside a special token (``tags.partial_tag_suffix(text, TAGS)`` says how much to hold back), so callers can
re-read the whole text on every streamed delta.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from jaxserve.reasoning.tags import first_tag

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
TERMINATORS = (END, CALL, RETURN)

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
_CONSTRAIN_RE = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_ROLE_RE = re.compile(r"<\|start\|>\s*([^\s<]+)")


@dataclass
class HarmonyMessage:
    """One message. ``channel`` None and ``plain`` True: text outside the format.
    ``header_done`` False: the output ended inside the header (``content`` is empty)."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    role: str | None = None
    content: str = ""
    header: str = ""  # the header's raw text (content again if the output ends inside it)
    header_done: bool = True
    terminator: str | None = None  # <|end|>, <|call|>, <|return|>, or None (not ended)
    plain: bool = False

    @property
    def function(self) -> str | None:
        """The function called (``to=functions.NAME``), or None."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions."):] or None
        return None


def parse_messages(text: str) -> list[HarmonyMessage]:
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        start, _ = first_tag(text, (START, CHANNEL), pos)
        if start < 0:
            messages.append(HarmonyMessage(content=text[pos:], plain=True))
            break
        if start > pos:
            messages.append(HarmonyMessage(content=text[pos:start], plain=True))
        body = text.find(MESSAGE, start)
        if body < 0:
            messages.append(HarmonyMessage(header=text[start:], header_done=False))
            break
        header = text[start:body]
        msg = HarmonyMessage(header=header + MESSAGE, channel=_group(_CHANNEL_RE, header),
                             recipient=_group(_RECIPIENT_RE, header), role=_group(_ROLE_RE, header),
                             content_type=_group(_CONSTRAIN_RE, header))
        body += len(MESSAGE)
        # A message ends at its terminator; a new header without one also ends it.
        end, tag = first_tag(text, TERMINATORS + (START,), body)
        if end < 0:
            msg.content, pos = text[body:], len(text)
        else:
            msg.content = text[body:end]
            if tag == START:
                pos = end
            else:
                msg.terminator, pos = tag, end + len(tag)
        messages.append(msg)
    return messages


def tool_call_block(name: str, arguments: str, *, ended: bool = True) -> str:
    """A call in harmony's canonical form (what the ``openai`` tool parser reads)."""
    return (f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}"
            + (CALL if ended else ""))


def _group(pattern: re.Pattern, text: str) -> str | None:
    m = pattern.search(text)
    return m.group(1) if m else None
