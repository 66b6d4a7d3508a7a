"""Tool-call parsers: a model's tool-call text -> OpenAI ``tool_calls`` (streamed too).

``--tool-call-parser NAME`` picks one of TOOL_PARSERS (vLLM's names) for
``tool_choice="auto"``; the constrained choices ("required", a named function) use
``forced.JsonArrayToolStreamer`` / ``forced.NamedToolStreamer`` whatever the model.
"""
from __future__ import annotations

from server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolDelta,
    ToolParser,
    ToolStreamer,
    make_tool_call_id,
    tool_call,
)
from server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from server.tool_parsers.forced import JsonArrayToolStreamer, NamedToolStreamer
from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser
from server.tool_parsers.mistral import MistralToolParser
from server.tool_parsers.openai import OpenAIToolParser
from server.tool_parsers.pythonic import PythonicToolParser
from server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,  # V3.1's form; the same parser reads both
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,  # GPT-OSS (harmony)
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}; got {name!r}") from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "JsonArrayToolStreamer",
    "NamedToolStreamer",
    "ToolDelta",
    "ToolParser",
    "ToolStreamer",
    "get_tool_parser",
    "make_tool_call_id",
    "tool_call",
]
