"""Qwen3 (dense): the Llama decoder with an RMSNorm on q and k per head, before rope."""
from __future__ import annotations

from models.base import Weight
from models.config import ModelArchConfig
from models.llama import LAYER, LlamaForCausalLM, rms_norm
from models.qwen2 import refuse_layer_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        refuse_layer_sliding_window(cfg)
        bias = bool(cfg.get("attention_bias", False))  # on all four projections, like Llama
        return dict(attention_bias=bias, o_bias=bias)

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        return super().weight_map(c) | {
            "q_norm": Weight(LAYER + "self_attn.q_norm.weight", ("num_hidden_layers", "head_dim")),
            "k_norm": Weight(LAYER + "self_attn.k_norm.weight", ("num_hidden_layers", "head_dim")),
        }

    def norm_qk(self, q, k, lw):
        eps = self.config.rms_norm_eps
        return rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
