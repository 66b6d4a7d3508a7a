"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a
sparse MoE block in every layer plus a shared expert: a dense SiLU MLP every token goes
through, scaled by sigmoid(x @ shared_expert_gate)."""
from __future__ import annotations

import jax

from models.base import MODEL, Weight
from models.config import ModelArchConfig
from models.llama import LAYER
from models.moe import SparseMoeMLP, moe_arch_fields
from models.quantization import linear
from models.qwen2 import Qwen2ForCausalLM

_L, _D, _FS = "num_hidden_layers", "hidden_size", "shared_expert_intermediate_size"


class Qwen2MoeForCausalLM(SparseMoeMLP, Qwen2ForCausalLM):
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        fields = super().arch_fields(cfg) | moe_arch_fields(
            cfg, num_experts=cfg.get("num_experts"), moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
        return fields | dict(attention_bias=bool(cfg.get("qkv_bias", True)),
                             shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        m = super().weight_map(c)
        if not c.shared_expert_intermediate_size:
            return m
        cols, rows = (None, None, MODEL), (None, MODEL, None)
        return m | {
            "shared_gate_proj": Weight(LAYER + "mlp.shared_expert.gate_proj.weight", (_L, _D, _FS), cols, True),
            "shared_up_proj": Weight(LAYER + "mlp.shared_expert.up_proj.weight", (_L, _D, _FS), cols, True),
            "shared_down_proj": Weight(LAYER + "mlp.shared_expert.down_proj.weight", (_L, _FS, _D), rows, True),
            "shared_expert_gate": Weight(LAYER + "mlp.shared_expert_gate.weight", (_L, _D, "1"), transpose=True),
        }

    def mlp(self, x, lw):
        out = super().mlp(x, lw)
        if not self.config.shared_expert_intermediate_size:
            return out
        shared = linear(jax.nn.silu(linear(x, lw, "shared_gate_proj")) * linear(x, lw, "shared_up_proj"), lw,
                        "shared_down_proj")
        return out + jax.nn.sigmoid(x @ lw["shared_expert_gate"]) * shared
