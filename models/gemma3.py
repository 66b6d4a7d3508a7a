"""Gemma 3 (text): Gemma 2's layer with q/k RMSNorm (1 + w) per head, five sliding layers
per global one, no soft-capping, and its own rope base on the sliding layers
(``rope_local_base_freq``, unscaled; the global layers use rope_theta and rope_scaling)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.base import Weight
from models.config import ModelArchConfig
from models.gemma2 import Gemma2ForCausalLM, gemma_rms_norm
from models.llama import LAYER
from models.rope import rope_inv_freq


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    sliding_pattern = 6

    @classmethod
    def rope_config(cls, cfg: dict) -> dict:
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers >= 5: one rope per layer type
            return dict(cfg, rope_parameters=rope["full_attention"])
        return cfg

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        rope = cfg.get("rope_parameters") or {}
        local = rope.get("sliding_attention", {}).get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if pattern and not cfg.get("layer_types"):
            cfg = dict(cfg, layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(cfg["num_hidden_layers"])])
        return super().arch_fields(cfg) | dict(rope_local_theta=float(local))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        return super().weight_map(c) | {
            "q_norm": Weight(LAYER + "self_attn.q_norm.weight", ("num_hidden_layers", "head_dim")),
            "k_norm": Weight(LAYER + "self_attn.k_norm.weight", ("num_hidden_layers", "head_dim")),
        }

    def __init__(self, config: ModelArchConfig, weights: dict, **kw) -> None:
        super().__init__(config, weights, **kw)
        # Float32 and replicated like inv_freq (models/sharding.py: place_variables).
        self.inv_freq_local = nnx.Variable(jnp.asarray(rope_inv_freq(config.head_dim, config.rope_local_theta, {})))

    def norm_qk(self, q, k, lw):
        eps = self.config.rms_norm_eps
        return gemma_rms_norm(q, lw["q_norm"], eps), gemma_rms_norm(k, lw["k_norm"], eps)

    def rope_inv_freq(self, layer):
        sliding = self.config.sliding_window_layers
        if sliding is None:
            return self.inv_freq[...]
        if isinstance(layer, int):
            return self.inv_freq_local[...] if sliding[layer] else self.inv_freq[...]
        return jnp.where(jnp.asarray(sliding)[layer], self.inv_freq_local[...], self.inv_freq[...])
