"""Finding markers in streamed text: the reasoning parsers' and the tool-call parsers'
(server/tool_parsers) one helper for a tag split across two deltas, and one for the
first of several tags."""
from __future__ import annotations


def partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of
    ``tags`` (held back from a stream until the next delta tells)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def first_tag(text: str, tags: tuple[str, ...], pos: int = 0) -> tuple[int, str]:
    """The earliest of ``tags`` in ``text`` from ``pos``: (index, tag), or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag, pos)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found
