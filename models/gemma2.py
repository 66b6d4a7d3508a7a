"""Gemma 2: the Llama decoder reshaped the Gemma way.

- RMSNorm scales by (1 + w), in float32; the embedding is scaled by sqrt(D);
- four norms per layer: before and after attention, before and after the MLP (the
  "post" norms apply to the block's output, before the residual add);
- GeGLU MLP (tanh-approximated GELU on the gate);
- attention scores scaled by query_pre_attn_scalar^-1/2 and soft-capped
  (cap * tanh(s / cap)), the logits soft-capped the same way;
- sliding-window and global layers interleaved (``layer_types``; layer 0 slides), the
  window per layer chosen by the attention (pallas_kernels/backend.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.batch_invariance import rowwise
from models.base import Weight
from models.config import ModelArchConfig, hf_common_fields
from models.llama import LAYER, LlamaForCausalLM
from models.quantization import linear

_GELU = {"gelu_pytorch_tanh": True, "gelu_tanh": True, "gelu": False}  # -> approximate


def gemma_rms_norm(x, w, eps):
    """Gemma's RMSNorm (scale 1 + w), per fixed tile of rows in batch-invariant mode (llama.rms_norm)."""
    def norm(x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return rowwise(norm, x)


def layer_types(cfg: dict, sliding_every_but: int) -> list[str]:
    """config.json's layer_types, or the older configs' pattern: every
    ``sliding_every_but``-th layer global, the others sliding."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % sliding_every_but == 0 else "sliding_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{cfg['architectures'][0]}: layer_types must list full_attention / sliding_attention for "
                         f"each of the {n} layers, got {types!r}")
    return types


class Gemma2ForCausalLM(LlamaForCausalLM):
    architectures = ("Gemma2ForCausalLM",)
    sliding_pattern = 2  # without layer_types: every 2nd layer global

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU:
            raise ValueError(f"hidden_activation {act!r} is not supported ({', '.join(_GELU)})")
        return ModelArchConfig(**hf_common_fields(cls.rope_config(cfg)), **cls.arch_fields(cfg))

    @classmethod
    def rope_config(cls, cfg: dict) -> dict:
        """The config as hf_common_fields reads it (Gemma 3 picks the global layers' rope)."""
        return cfg

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        types = layer_types(cfg, cls.sliding_pattern)
        window = cfg.get("sliding_window")
        bias = bool(cfg.get("attention_bias", False))
        return dict(attention_bias=bias, o_bias=bias, sliding_window=window,
                    sliding_window_layers=tuple(t == "sliding_attention" for t in types) if window else None,
                    attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                    final_logit_softcapping=cfg.get("final_logit_softcapping"),
                    query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        d = ("num_hidden_layers", "hidden_size")
        return super().weight_map(c) | {
            "pre_feedforward_layernorm": Weight(LAYER + "pre_feedforward_layernorm.weight", d),
            "post_feedforward_layernorm": Weight(LAYER + "post_feedforward_layernorm.weight", d),
        }

    def norm_fn(self, x, w):
        return gemma_rms_norm(x, w, self.config.rms_norm_eps)

    def embed(self, input_ids):
        h = self.embed_tokens[...][input_ids].astype(self.dtype)
        return h * jnp.asarray(self.config.hidden_size ** 0.5, h.dtype)  # rounded to the dtype, as HF

    def mlp(self, x, lw):
        gate, up = linear(x, lw, "gate_proj"), linear(x, lw, "up_proj")
        return linear(jax.nn.gelu(gate, approximate=True) * up, lw, "down_proj")

    def decoder_layer(self, h, kv_cache, lw, layer, positions, md, attention_fn):
        attn, kv_cache = self.attention(self.norm_fn(h, lw["input_layernorm"]), kv_cache, lw, layer, positions, md,
                                        attention_fn)
        h = h + self.norm_fn(attn, lw["post_attention_layernorm"])
        mlp = self.mlp(self.norm_fn(h, lw["pre_feedforward_layernorm"]), lw)
        return h + self.norm_fn(mlp, lw["post_feedforward_layernorm"]), kv_cache

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
