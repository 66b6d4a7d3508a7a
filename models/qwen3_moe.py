"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with a sparse MoE block in every layer
(models/moe.py; router softmax, top-k, renormalised when norm_topk_prob)."""
from __future__ import annotations

from models.moe import SparseMoeMLP, moe_arch_fields
from models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(SparseMoeMLP, Qwen3ForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        # The hub's configs say num_experts; transformers 5 writes num_local_experts.
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        return super().arch_fields(cfg) | moe_arch_fields(
            cfg, num_experts=experts, moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
