"""Llama-family decoder in Flax NNX: Llama 2/3, SmolLM, Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm). One file, one model, parameterised by ModelArchConfig.

Layer weights are stacked on a leading layer axis and the layers run under
``lax.scan`` (``scan_layers=False`` unrolls them), so compile time does not grow
with depth. Projections are stored [in, out] so a matmul is ``x @ w``.
The KV cache is [L, P, S, 2K, H] (DESIGN §4) and is threaded through the scan.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention_metadata import AttentionMetadata
from models.config import ModelArchConfig
from models.rope import apply_rope, rope_inv_freq

# Names and shapes of the stacked per-layer weights (L layers, D model dim, F mlp dim,
# N heads, K kv heads, H head dim).
def layer_param_shapes(c: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    L, D, F = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes = {
        "input_layernorm": (L, D),
        "q_proj": (L, D, N * H),
        "k_proj": (L, D, K * H),
        "v_proj": (L, D, K * H),
        "o_proj": (L, N * H, D),
        "post_attention_layernorm": (L, D),
        "gate_proj": (L, D, F),
        "up_proj": (L, D, F),
        "down_proj": (L, F, D),
    }
    if c.attention_bias:
        shapes |= {"q_bias": (L, N * H), "k_bias": (L, K * H), "v_bias": (L, K * H)}
    if c.o_bias:
        shapes |= {"o_bias": (L, D)}
    if c.mlp_bias:
        shapes |= {"gate_bias": (L, F), "up_bias": (L, F), "down_bias": (L, D)}
    if c.qk_norm:
        shapes |= {"q_norm": (L, H), "k_norm": (L, H)}
    return shapes


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked [L, ...]."""

    def __init__(self, config: ModelArchConfig, weights: dict[str, np.ndarray], dtype) -> None:
        for name, shape in layer_param_shapes(config).items():
            w = weights[name]
            assert w.shape == shape, f"{name}: expected {shape}, got {w.shape}"
            setattr(self, name, nnx.Param(jnp.asarray(w, dtype)))


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelArchConfig, weights: dict[str, np.ndarray], *, dtype=jnp.float32,
                 scan_layers: bool = True) -> None:
        self.config = config
        self.scan_layers = scan_layers
        self.embed_tokens = nnx.Param(jnp.asarray(weights["embed_tokens"], dtype))  # [V, D]
        self.layers = DecoderLayers(config, weights, dtype)
        self.norm = nnx.Param(jnp.asarray(weights["norm"], dtype))  # [D]
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.asarray(weights["lm_head"], dtype))  # [D, V]
        self.inv_freq = nnx.Variable(jnp.asarray(
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)))

    def __call__(self, input_ids, positions, kv_cache, md: AttentionMetadata, attention_fn: Callable):
        """input_ids, positions: [T] int32; kv_cache: [L, P, S, 2K, H].
        attention_fn(q, k, v, kv_cache, layer, md) -> (o [T, N, H], kv_cache).
        Returns (hidden [T, D] after the final norm, kv_cache)."""
        c = self.config
        h = self.embed_tokens[...][input_ids]
        inv_freq = self.inv_freq[...]
        names = list(layer_param_shapes(c))
        stacked = {n: getattr(self.layers, n)[...] for n in names}

        def layer_fn(h, kv_cache, lw, layer):
            t = h.shape[0]
            N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            x = rms_norm(h, lw["input_layernorm"], c.rms_norm_eps)
            q, k, v = x @ lw["q_proj"], x @ lw["k_proj"], x @ lw["v_proj"]
            if c.attention_bias:
                q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
            q, k, v = q.reshape(t, N, H), k.reshape(t, K, H), v.reshape(t, K, H)
            if c.qk_norm:
                q = rms_norm(q, lw["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, lw["k_norm"], c.rms_norm_eps)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            o, kv_cache = attention_fn(q, k, v, kv_cache, layer, md)
            attn = o.reshape(t, N * H) @ lw["o_proj"]
            if c.o_bias:
                attn = attn + lw["o_bias"]
            h = h + attn
            x = rms_norm(h, lw["post_attention_layernorm"], c.rms_norm_eps)
            gate, up = x @ lw["gate_proj"], x @ lw["up_proj"]
            if c.mlp_bias:
                gate, up = gate + lw["gate_bias"], up + lw["up_bias"]
            mlp = (jax.nn.silu(gate) * up) @ lw["down_proj"]
            if c.mlp_bias:
                mlp = mlp + lw["down_bias"]
            return h + mlp, kv_cache

        if self.scan_layers:
            def body(carry, xs):
                h, kv = carry
                lw, layer = xs
                h, kv = layer_fn(h, kv, lw, layer)
                return (h, kv), None

            (h, kv_cache), _ = jax.lax.scan(body, (h, kv_cache), (stacked, jnp.arange(c.num_hidden_layers)))
        else:
            for i in range(c.num_hidden_layers):
                h, kv_cache = layer_fn(h, kv_cache, {n: w[i] for n, w in stacked.items()}, i)
        return rms_norm(h, self.norm[...], c.rms_norm_eps), kv_cache

    def compute_logits(self, hidden):
        """hidden: [R, D] -> logits [R, V] in float32."""
        if self.config.tie_word_embeddings:
            return (hidden @ self.embed_tokens[...].T).astype(jnp.float32)
        return (hidden @ self.lm_head[...]).astype(jnp.float32)
