"""<think>...</think> reasoning, as Qwen3 and DeepSeek-R1 write it.

Qwen3: the model opens <think> itself; output that does not start with <think> is
all answer, tags included (thinking switched off, or a model that skipped it) --
unless the prompt already opened it (Qwen3-2507 Thinking's template ends the prompt
with <think>): ``prompt_opens_reasoning`` tells, and the output then starts inside
the reasoning. DeepSeek-R1: the chat template
already opened <think>, so output before </think> is reasoning even without an
opening tag; output without </think> is all reasoning (it was cut off mid-thought).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.reasoning.tags import partial_tag_suffix


@dataclass(slots=True)
class ReasoningDelta:
    """What a streamed chunk adds: to the reasoning, to the answer, or to both."""

    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    start_token = "<think>"
    end_token = "</think>"
    # Without an end tag: is the text reasoning (True) or answer (False)?
    unterminated_is_reasoning = False
    # The format is written in special tokens: the output must be decoded with them.
    keeps_special_tokens = False

    @property
    def tags(self) -> tuple[str, ...]:
        """The markers a streamed delta may end inside of (held back until whole)."""
        return (self.start_token, self.end_token)

    def __init__(self, tokenizer) -> None:
        vocab = tokenizer.get_vocab()
        self.start_token_id = vocab.get(self.start_token)
        self.end_token_id = vocab.get(self.end_token)
        if self.end_token_id is None:
            raise ValueError(f"reasoning parser {type(self).__name__}: the tokenizer has no {self.end_token!r} token")

    # ------------------------------------------------------------------ token ids (engine)
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when the last think tag in ``token_ids`` (prompt + output) closes the
        reasoning: the answer, and so any constraint, starts after it. A later <think>
        reopens it."""
        return self._last_tag(token_ids) == self.end_token_id

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """The prompt's last think tag is an open <think>: the output starts mid-reasoning."""
        return self._last_tag(prompt_token_ids) == self.start_token_id

    def _last_tag(self, token_ids: Sequence[int]) -> int | None:
        """The last <think> or </think> id in ``token_ids`` (None when there is neither)."""
        for t in reversed(token_ids):
            if t == self.end_token_id or t == self.start_token_id:
                return t
        return None

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The output ids after the end tag ([] while reasoning)."""
        ids = list(token_ids)
        if self.end_token_id not in ids:
            return []
        return ids[len(ids) - ids[::-1].index(self.end_token_id):]

    # ------------------------------------------------------------------ text (server)
    def extract_reasoning(self, text: str, *, opened: bool = False) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, content); None for an empty part. ``opened``:
        the prompt ended inside the reasoning (prompt_opens_reasoning)."""
        reasoning, content = self._split(text, opened)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, previous_text: str, delta_text: str, *,
                                    opened: bool = False) -> ReasoningDelta | None:
        """The part of ``delta_text`` that is reasoning and the part that is answer,
        given everything streamed before it. Tag text is never returned; a tag split
        over two deltas is held back until it is whole (the caller passes the held-back
        text again with the next delta: see ``StreamingReasoning``)."""
        current = previous_text + delta_text
        r_prev, c_prev = self._split(previous_text, opened)
        r_cur, c_cur = self._split(current, opened)
        reasoning = r_cur.removeprefix(r_prev)
        content = c_cur.removeprefix(c_prev)
        if not reasoning and not content:
            return None
        return ReasoningDelta(reasoning=reasoning or None, content=content or None)

    def _split(self, text: str, opened: bool = False) -> tuple[str, str]:
        opened = opened or text.lstrip().startswith(self.start_token) or self.start_token.startswith(text.lstrip())
        if not (opened or self.unterminated_is_reasoning):
            return "", text
        before, sep, after = text.partition(self.end_token)
        if sep:
            return _strip_start(before, self.start_token), after.lstrip("\n")
        return _strip_start(text, self.start_token), ""


def _strip_start(text: str, start: str) -> str:
    text = text.lstrip()
    if text.startswith(start):
        text = text[len(start):]
    elif start.startswith(text):  # a partial <think> so far
        return ""
    return text.lstrip("\n")


class StreamingReasoning:
    """Per-choice streaming state: feed each text delta, get the reasoning and content
    deltas. Text that may be the start of a tag waits for the next delta."""

    def __init__(self, parser: ReasoningParser, *, opened: bool = False) -> None:
        self.parser = parser
        self.opened = opened  # the prompt ended inside the reasoning
        self.text = ""  # everything released to the parser so far
        self.pending = ""  # held back: may be a partial tag

    def feed(self, delta: str, *, final: bool = False) -> ReasoningDelta | None:
        text = self.pending + delta
        self.pending = ""
        if not final:
            hold = partial_tag_suffix(text, self.parser.tags)
            if hold:
                text, self.pending = text[:-hold], text[-hold:]
        if not text:
            return None
        out = self.parser.extract_reasoning_streaming(self.text, text, opened=self.opened)
        self.text += text
        return out


class Qwen3ReasoningParser(ReasoningParser):
    unterminated_is_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    unterminated_is_reasoning = True
