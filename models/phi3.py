"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Llama decoder with its projections
fused in the checkpoint and LongRoPE.

- ``qkv_proj`` ([N H + 2 K H, D]) and ``gate_up_proj`` ([2 F, D]) are read as the
  separate q / k / v and gate / up params, each a row block of the fused tensor
  (``Weight.row_offset``), so tensor parallelism splits them by heads and columns like
  Llama's, with nothing fused on the device.
- LongRoPE (``rope_scaling`` of type ``longrope``, or the older ``su`` / ``yarn`` names):
  per-dimension factors, short or long; the long ones apply to every position when the
  engine's max_model_len passes ``original_max_position_embeddings`` (vLLM's rule,
  models/rope.longrope_settings), and cos / sin are scaled by the attention factor.
- ``partial_rotary_factor`` (Phi-4-mini): only the first part of each head rotates.
- ``sliding_window`` applies to every layer when set (Phi-3-mini-4k: 2047).
"""
from __future__ import annotations

from models.base import Weight
from models.config import ModelArchConfig
from models.llama import COLUMNS, KH, LAYER, NH, L, D, F, LlamaForCausalLM

_QKV = LAYER + "self_attn.qkv_proj.weight"
_GATE_UP = LAYER + "mlp.gate_up_proj.weight"
_QKV_ROWS = "num_attention_heads*head_dim+2*num_key_value_heads*head_dim"


def _phi3_rope(cfg: dict) -> dict:
    """config.json with its rope dict in the form models/rope.py reads: the type named
    longrope, the trained length and the partial rotary factor inside it."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    kind = rope.get("rope_type") or rope.get("type")
    if kind in ("su", "yarn", "longrope"):  # HF reads the old names as longrope
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
        rope.setdefault("original_max_position_embeddings",
                        cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096))
    if cfg.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return {**cfg, key: rope or None}


class Phi3ForCausalLM(LlamaForCausalLM):
    architectures = ("Phi3ForCausalLM",)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        arch = super().from_hf_config(_phi3_rope(cfg))
        rotary = arch.head_dim * arch.rope_scaling.get("partial_rotary_factor", 1.0)
        if rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"partial_rotary_factor: head_dim * factor must be an even integer, got {rotary}")
        return arch

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        return dict(sliding_window=cfg.get("sliding_window"))  # every layer; no biases

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        m = super().weight_map(c)
        m |= {
            "q_proj": Weight(_QKV, (L, D, NH), COLUMNS, transpose=True, row_offset="0", fused_rows=_QKV_ROWS),
            "k_proj": Weight(_QKV, (L, D, KH), COLUMNS, transpose=True, row_offset=NH, fused_rows=_QKV_ROWS),
            "v_proj": Weight(_QKV, (L, D, KH), COLUMNS, transpose=True, row_offset=f"{NH}+{KH}",
                             fused_rows=_QKV_ROWS),
            "gate_proj": Weight(_GATE_UP, (L, D, F), COLUMNS, transpose=True, row_offset="0",
                                fused_rows=f"2*{F}"),
            "up_proj": Weight(_GATE_UP, (L, D, F), COLUMNS, transpose=True, row_offset=F, fused_rows=f"2*{F}"),
        }
        return m
