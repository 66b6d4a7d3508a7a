"""<think> reasoning parsers (qwen3, deepseek_r1): the whole-output split, the streamed
split (any delta size gives the same parts), and the token-id checks the engine uses."""
import pytest

from jaxserve.reasoning import REASONING_PARSERS, get_reasoning_parser
from jaxserve.reasoning.think_parser import StreamingReasoning

START, END = 5, 6
THINK_PARSERS = ["qwen3", "deepseek_r1"]


class Tok:
    def get_vocab(self):
        return {"<think>": START, "</think>": END}


CASES = [  # text, opened by the prompt, qwen3 (reasoning, content), deepseek_r1 (reasoning, content)
    ("<think>\nhmm, 2+2</think>\n\nIt is 4.", False, ("hmm, 2+2", "It is 4."), ("hmm, 2+2", "It is 4.")),
    ("It is 4.", False, (None, "It is 4."), ("It is 4.", None)),
    ("<think>cut off mid-thought", False, ("cut off mid-thought", None), ("cut off mid-thought", None)),
    ("still thinking</think>Answer", True, ("still thinking", "Answer"), ("still thinking", "Answer")),
    ("only thought", True, ("only thought", None), ("only thought", None)),
    ("no tags</think>x", False, (None, "no tags</think>x"), ("no tags", "x")),
]


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("text, opened, qwen3, r1", CASES)
def test_split_whole_and_streamed(name, text, opened, qwen3, r1):
    parser = get_reasoning_parser(name)(Tok())
    expected = qwen3 if name == "qwen3" else r1
    assert parser.extract_reasoning(text, opened=opened) == expected
    for step in (1, 2, 5, 100):
        assert split_streamed(parser, text, step, opened=opened) == expected, step


def split_streamed(parser, text: str, step: int, *, opened: bool = False):
    """(reasoning, content) of ``text`` streamed in deltas of ``step`` characters."""
    stream = StreamingReasoning(parser, opened=opened)
    reasoning = content = ""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, final=k == len(pieces) - 1)
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_token_checks(name):
    parser = get_reasoning_parser(name)(Tok())
    assert parser.is_reasoning_end([1, START, 2, END, 3])
    assert not parser.is_reasoning_end([1, START, 2])
    assert not parser.is_reasoning_end([END, 1, START, 2])  # reopened
    assert parser.prompt_opens_reasoning([1, 2, START])
    assert not parser.prompt_opens_reasoning([1, START, 2, END])
    assert parser.extract_content_ids([START, 9, END, 7, 8]) == [7, 8]
    assert parser.extract_content_ids([START, 9]) == []


def test_unknown_parser_and_missing_token():
    assert set(THINK_PARSERS) <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("nope")

    class NoTags:
        def get_vocab(self):
            return {}
    with pytest.raises(ValueError, match="</think>"):
        get_reasoning_parser("qwen3")(NoTags())
