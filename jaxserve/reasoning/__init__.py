"""Reasoning parsers: split a thinking model's output into reasoning and answer.

Used in two places: the engine (a grammar constraint applies only after the
reasoning has ended: ``is_reasoning_end`` over token ids) and the server (the text
before the end tag becomes ``reasoning_content``, streamed too). vLLM's names:
``--reasoning-parser qwen3|deepseek_r1|gpt_oss|openai_gptoss|granite``.
"""
from __future__ import annotations

from jaxserve.reasoning.gpt_oss import GptOssReasoningParser
from jaxserve.reasoning.granite import GraniteReasoningParser
from jaxserve.reasoning.think_parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": GptOssReasoningParser,
    "openai_gptoss": GptOssReasoningParser,  # vLLM's name
    "granite": GraniteReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}; "
                         f"got {name!r}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
