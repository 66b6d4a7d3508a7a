"""IBM Granite 3.2+ reasoning (vLLM's ``granite``), written in plain words, not tags::

    Here is my thought process: ... Here is my response: ...

(``Here's`` too). Output that does not start with the thought-process marker is all
answer; output cut off before the response marker is all reasoning. The markers are
several ordinary tokens, so the engine side decodes the output's last tokens to see
whether the response marker has been written.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from jaxserve.reasoning.think_parser import ReasoningParser

THINK_MARKERS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_MARKERS = ("Here is my response:", "Here's my response:")
_RESPONSE_RE = re.compile("|".join(re.escape(m) for m in RESPONSE_MARKERS))
# Enough tokens to hold the response marker however it was tokenized.
_TAIL_TOKENS = 24


class GraniteReasoningParser(ReasoningParser):
    tags = THINK_MARKERS + RESPONSE_MARKERS
    start_token, end_token = THINK_MARKERS[0], RESPONSE_MARKERS[0]

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ token ids (engine)
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """The response marker is in the last tokens (the engine asks after every step,
        and remembers the first yes)."""
        tail = self.tokenizer.decode(list(token_ids[-_TAIL_TOKENS:]), skip_special_tokens=True)
        return _RESPONSE_RE.search(tail) is not None

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        return False  # the model writes the thought-process marker itself

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids after the response marker ([] while reasoning)."""
        ids = list(token_ids)
        for k in range(1, len(ids) + 1):
            if _RESPONSE_RE.search(self.tokenizer.decode(ids[:k], skip_special_tokens=True)):
                return ids[k:]
        return []

    # ------------------------------------------------------------------ text (server)
    def _split(self, text: str, opened: bool = False) -> tuple[str, str]:
        head = text.lstrip()
        marker = next((m for m in THINK_MARKERS if head.startswith(m)), None)
        if marker is None:
            if any(m.startswith(head) for m in THINK_MARKERS):
                return "", ""  # the marker may still be forming
            return "", text
        body = head[len(marker):]
        m = _RESPONSE_RE.search(body)
        if m is None:
            return body.lstrip(), ""
        return body[:m.start()].lstrip(), body[m.end():].lstrip()
