"""Mixtral: Mistral's attention with a sparse MoE block in every layer (models/moe.py;
router softmax, top-k, always renormalised; experts w1 = gate, w3 = up, w2 = down)."""
from __future__ import annotations

from models.mistral import MistralForCausalLM
from models.moe import SparseMoeMLP, moe_arch_fields


class MixtralForCausalLM(SparseMoeMLP, MistralForCausalLM):
    architectures = ("MixtralForCausalLM",)
    router_name = "block_sparse_moe.gate.weight"
    expert_names = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                    "block_sparse_moe.experts.{e}.w2.weight")

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        return super().arch_fields(cfg) | moe_arch_fields(
            cfg, num_experts=cfg.get("num_local_experts"), moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True)
