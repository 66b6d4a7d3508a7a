"""Mistral: the Llama decoder with a sliding attention window on every layer."""
from __future__ import annotations

from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    architectures = ("MistralForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return dict(attention_bias=bias, o_bias=bias, sliding_window=window)
