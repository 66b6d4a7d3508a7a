"""Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases (always) and none on o_proj."""
from __future__ import annotations

from models.llama import LlamaForCausalLM


def refuse_layer_sliding_window(cfg: dict) -> None:
    """Qwen's use_sliding_window puts a window on some layers only: not supported."""
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{cfg['architectures'][0]} with use_sliding_window=true (a window on some layers) "
                         "is not supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        refuse_layer_sliding_window(cfg)
        return dict(attention_bias=True, o_bias=False)
