"""GPT-OSS (harmony) and Granite reasoning, and the ``openai`` tool-call parser: the
whole-output split, the same output streamed in deltas of 1, 2, 5 and 100 characters,
and the token-id checks the engine uses (a fake tokenizer whose ids are strings)."""
import json

import pytest

from jaxserve.reasoning import get_reasoning_parser, harmony
from jaxserve.reasoning.tags import partial_tag_suffix
from server.tool_parsers import get_tool_parser
from tests.reasoning.test_think_parsers import split_streamed

CALL_ARGS = {"city": "Paris", "days": 3}


class Tok:
    """Ids 0.. are whole strings: harmony's tags and a few words."""

    PIECES = list(harmony.TAGS) + ["assistant", "analysis", "final", "commentary", " to=functions.get_weather",
                                   " ", "json", "Let me think.", "It is sunny.", '{"city": "Paris"}',
                                   "Here is my", " thought process:", " hmm", " Here is", " my response:", " Hi"]

    def get_vocab(self):
        return {p: i for i, p in enumerate(self.PIECES)}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)

    def ids(self, *pieces):
        return [self.PIECES.index(p) for p in pieces]


def check_split(name: str, text: str, expected) -> None:
    parser = get_reasoning_parser(name)(Tok())
    assert parser.extract_reasoning(text) == expected
    for step in (1, 2, 5, 100):
        assert split_streamed(parser, text, step) == expected, step


# ----------------------------------------------------------------------------- harmony
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. <|x|> is not a tag.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city":"Paris", "days": 3}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
BLOCK = harmony.tool_call_block("get_weather", '{"city":"Paris", "days": 3}')

HARMONY_CASES = [
    (ANALYSIS + FINAL[: -len("<|return|>")], ("The user wants the weather. <|x|> is not a tag.", "It is sunny in Paris.")),
    (ANALYSIS + FINAL, ("The user wants the weather. <|x|> is not a tag.", "It is sunny in Paris.")),
    (ANALYSIS + PREAMBLE + CALL, ("The user wants the weather. <|x|> is not a tag.", "Checking the forecast." + BLOCK)),
    # the output stops before <|call|> (a stop token): the block is still whole for the tool parser
    (ANALYSIS + CALL[: -len("<|call|>")], ("The user wants the weather. <|x|> is not a tag.", BLOCK[: -len("<|call|>")])),
    ("<|channel|>analysis<|message|>cut off mid-thought", ("cut off mid-thought", None)),
    ("A model that ignored the format.", (None, "A model that ignored the format.")),
    # the recipient before the channel (harmony allows both orders)
    ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
     '{"city":"Paris", "days": 3}<|call|>', (None, BLOCK)),
]


@pytest.mark.parametrize("name", ["gpt_oss", "openai_gptoss"])
@pytest.mark.parametrize("text, expected", HARMONY_CASES)
def test_harmony_split_whole_and_streamed(name, text, expected):
    check_split(name, text, expected)
    assert get_reasoning_parser(name)(Tok()).keeps_special_tokens


def test_harmony_messages():
    msgs = harmony.parse_messages(ANALYSIS + PREAMBLE + CALL + FINAL)
    assert [(m.channel, m.function, m.terminator) for m in msgs] == [
        ("analysis", None, "<|end|>"), ("commentary", None, "<|end|>"),
        ("commentary", "get_weather", "<|call|>"), ("final", None, "<|return|>")]
    assert msgs[2].content_type == "json" and msgs[3].role == "assistant"
    # monotone: every prefix (held back at a partial tag) parses to a prefix of the whole
    text = ANALYSIS + CALL
    for n in range(len(text)):
        cut = text[:n]
        cut = cut[: len(cut) - partial_tag_suffix(cut, harmony.TAGS)]
        assert not any(m.plain and m.content.startswith("<|") for m in harmony.parse_messages(cut)), cut


def test_harmony_token_checks():
    tok = Tok()
    parser = get_reasoning_parser("gpt_oss")(tok)
    analysis = tok.ids("<|channel|>", "analysis", "<|message|>", "Let me think.", "<|end|>")
    final_header = tok.ids("<|start|>", "assistant", "<|channel|>", "final", "<|message|>")
    assert not parser.is_reasoning_end(analysis)
    assert not parser.is_reasoning_end(analysis + final_header[:-1])  # the header is not whole yet
    assert parser.is_reasoning_end(analysis + final_header)
    assert parser.is_reasoning_end(analysis + final_header + tok.ids("It is sunny."))
    call = tok.ids("<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.get_weather", " ",
                   "<|constrain|>", "json", "<|message|>", '{"city": "Paris"}')
    assert not parser.is_reasoning_end(analysis + call)
    assert parser.extract_content_ids(analysis + final_header + tok.ids("It is sunny.")) == tok.ids("It is sunny.")
    assert parser.extract_content_ids(analysis) == []
    assert not parser.prompt_opens_reasoning(tok.ids("<|start|>", "assistant"))

    class NoHarmony:
        def get_vocab(self):
            return {"<think>": 1}
    with pytest.raises(ValueError, match="harmony"):
        get_reasoning_parser("gpt_oss")(NoHarmony())


# ----------------------------------------------------------------------------- openai tool parser
def stream_tools(parser, text: str, step: int):
    streamer = parser.streamer()
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        out = streamer.feed(piece, final=k == len(pieces) - 1)
        content += out.content
        for d in out.tool_calls:
            entry = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
            entry["arguments"] += d["function"]["arguments"]
    return content or None, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


OPENAI_CASES = [
    # what the gpt_oss reasoning parser leaves as content
    ("Checking the forecast." + BLOCK, [("get_weather", CALL_ARGS)], "Checking the forecast."),
    # the raw output (no reasoning parser): the analysis is content too
    (ANALYSIS + CALL, [("get_weather", CALL_ARGS)], "The user wants the weather. <|x|> is not a tag."),
    (CALL[: -len("<|call|>")], [("get_weather", CALL_ARGS)], None),  # stopped at <|call|>
    (CALL + CALL.replace("Paris", "Oslo"), [("get_weather", CALL_ARGS), ("get_weather", CALL_ARGS | {"city": "Oslo"})],
     None),
    (ANALYSIS + FINAL, [], "The user wants the weather. <|x|> is not a tag.It is sunny in Paris."),
]


@pytest.mark.parametrize("text, calls, content", OPENAI_CASES)
def test_openai_tool_parser(text, calls, content):
    parser = get_tool_parser("openai")()
    got = parser.extract_tool_calls(text)
    assert got.tools_called == bool(calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == calls
    assert [c["function"]["arguments"] for c in got.tool_calls] == [json.dumps(a) for _, a in calls]
    assert got.content == content
    for step in (1, 2, 5, 100):
        assert stream_tools(parser, text, step) == (content, calls), step
    assert parser.skip_special_tokens(True) is False


def test_openai_tool_parser_keeps_unparsable_arguments():
    got = get_tool_parser("openai")().extract_tool_calls(harmony.tool_call_block("f", "{not json"))
    assert got.tool_calls[0]["function"] == {"name": "f", "arguments": "{not json"}


# ----------------------------------------------------------------------------- granite
GRANITE_CASES = [
    ("Here is my thought process: 2+2 is 4.\n\nHere is my response: It is 4.", ("2+2 is 4.\n\n", "It is 4.")),
    ("Here's my thought process:\nhmm\nHere's my response:\nFour.", ("hmm\n", "Four.")),
    ("It is 4.", (None, "It is 4.")),
    ("Here is my thought process: cut off", ("cut off", None)),
    ("Here is my thoughts on this: no markers", (None, "Here is my thoughts on this: no markers")),
]


@pytest.mark.parametrize("text, expected", GRANITE_CASES)
def test_granite_split_whole_and_streamed(text, expected):
    check_split("granite", text, expected)


def test_granite_token_checks():
    tok = Tok()
    parser = get_reasoning_parser("granite")(tok)
    thinking = tok.ids("Here is my", " thought process:", " hmm")
    assert not parser.is_reasoning_end(thinking)
    assert not parser.is_reasoning_end(thinking + tok.ids(" Here is"))
    done = thinking + tok.ids(" Here is", " my response:")
    assert parser.is_reasoning_end(done)
    assert parser.extract_content_ids(done + tok.ids(" Hi")) == tok.ids(" Hi")
    assert parser.extract_content_ids(thinking) == []
