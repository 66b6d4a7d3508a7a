"""Llama decoder in Flax NNX (Llama 2/3, SmolLM) and the base of its variants:
models/mistral.py (sliding window), models/qwen2.py (q/k/v bias), models/qwen3.py
(q/k RMSNorm).

Layer weights are stacked on a leading layer axis and the layers run under
``lax.scan`` (``scan_layers=False`` unrolls them), so compile time does not grow
with depth. Projections are stored [in, out] so a matmul is ``x @ w`` (``matmul``:
bf16 weights under float32 activations multiply x rounded to bf16, and on CPU the
stacked bf16 layer weights are stored as uint16 bit patterns for the scan, ``scan_safe``,
pallas_kernels/storage.py).
The KV cache is [L, P, S, 2K, H] (docs/design.md §4) and is threaded through the scan; with
KV cache groups (Gemma's local and global layers, jaxserve/core/kv_cache_groups.py) its
first axis is a group's slots, and the attention maps each layer to its slot.

Tensor parallelism (docs/design.md §5): q/k/v/gate/up are split by output columns, o/down
by input rows, the embedding and lm_head by vocabulary (padded to a multiple of tp;
``compute_logits`` drops the padding); the declarations are in ``weight_map``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models.base import MODEL, CausalLM, Weight, make_param
from models.batch_invariance import rowwise
from models.config import ModelArchConfig, hf_common_fields
from models.lora import LORA_A, LORA_B, LORA_MASK, LORA_ON
from models.quantization import GIDX, SCALE, ZERO, linear, matmul, matmul_weight_names, param_map, scan_safe
from models.rope import apply_rope, rope_attention_factor, rope_inv_freq
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.storage import stacked_weights_as_bits

# Axis sizes, as ModelArchConfig fields: L layers, D model dim, F mlp dim, V vocabulary
# (padded to a multiple of tp), NH / KH query / kv heads times the head dim.
L, D, F, V = "num_hidden_layers", "hidden_size", "intermediate_size", "padded_vocab_size"
NH, KH = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"
COLUMNS = (None, None, MODEL)  # [L, in, out] split by output columns (heads / MLP columns)
ROWS = (None, MODEL, None)  # [L, in, out] split by input rows
COLUMN_BIAS = (None, MODEL)  # [L, out] bias of a column-split projection
LAYER = "model.layers.{i}."


def rms_norm(x, w, eps):
    """RMSNorm over x's last axis (per fixed tile of rows in batch-invariant mode:
    XLA:CPU's reduction changed a row's bits at 4096 rows; models/batch_invariance.py)."""
    def norm(x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (xf * w.astype(jnp.float32)).astype(x.dtype)
    return rowwise(norm, x)


def lora_inputs(lora, dtype) -> tuple[dict, dict]:
    """The step's LoRA adapters (``__call__``'s ``lora``) as (per-layer buffers by name,
    stacked [L, ...]: {projection + LORA_A / LORA_B}, the step-wide entries every layer
    sees: the token mask in ``dtype`` and the on flag); ({}, {}) without."""
    if lora is None:
        return {}, {}
    buffers, mask, on = lora
    layers = {}
    for n, (a, b) in buffers.items():
        layers[n + LORA_A], layers[n + LORA_B] = a, b
    return layers, {LORA_MASK: mask.astype(dtype), LORA_ON: on}


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked [L, ...]. With ``bf16_bits``, a bfloat16
    weight is stored as its uint16 bit pattern (``scan_safe``: the layer scan on CPU)."""

    def __init__(self, config: ModelArchConfig, weights: dict, weight_map: dict[str, Weight], dtypes: dict,
                 bf16_bits: bool = False) -> None:
        for name, w in weight_map.items():
            # Quantized weights (int8 / fp8 / int4) and their scales, zeros and groups keep their dtype.
            own = jnp.dtype(weights[name].dtype).itemsize == 1 or name.endswith((SCALE, ZERO, GIDX))
            param = make_param(name, weights[name], w, config, None if own else dtypes[name])
            if bf16_bits and param.dtype == jnp.bfloat16:
                param = nnx.Param(scan_safe(param[...]), out_sharding=w.partition, eager_sharding=False)
            setattr(self, name, param)


class LayerWeights(nnx.Module):
    """One decoder layer's weights, each an array of its own (unrolled models): slices of
    the stacked arrays, which are then dropped."""

    def __init__(self, stacked: DecoderLayers, names: list[str], layer: int) -> None:
        for name in names:
            param = getattr(stacked, name)
            partition = param.get_metadata().get("out_sharding")
            setattr(self, name, nnx.Param(param[...][layer], out_sharding=partition[1:] if partition else None,
                                          eager_sharding=False))


def scan_layers(layer_fn: Callable, h, kv_cache, stacked: dict, start: int, stop: int):
    """Layers start..stop under one lax.scan: ``stacked`` {name: [stop - start, ...]} (the
    bf16 ones as their bit patterns: scan_safe), ``layer_fn(h, kv_cache, lw, layer)`` ->
    (h, kv_cache) with ``layer`` the traced global layer index. Returns (h, kv_cache)."""
    def body(carry, xs):
        h, kv = carry
        lw, layer = xs
        return layer_fn(h, kv, scan_safe(lw, restore=True), layer), None

    (h, kv_cache), _ = jax.lax.scan(body, (h, kv_cache), (stacked, jnp.arange(start, stop, dtype=jnp.int32)))
    return h, kv_cache


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM",)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        own = cls.arch_fields(cfg)
        return ModelArchConfig(**hf_common_fields(cfg), **own)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        """The ModelArchConfig flags this architecture reads from config.json. Llama:
        attention_bias puts biases on q/k/v/o, mlp_bias on gate/up/down."""
        bias = bool(cfg.get("attention_bias", False))
        return dict(attention_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        m = {
            # Split by vocabulary: the lookup is a local gather plus an all-reduce, and a
            # tied lm_head (its transpose) comes out split by vocabulary as well.
            "embed_tokens": Weight("model.embed_tokens.weight", (V, D), (MODEL, None)),
            "norm": Weight("model.norm.weight", (D,)),
        }
        if not c.tie_word_embeddings:
            m["lm_head"] = Weight("lm_head.weight", (D, V), (None, MODEL), transpose=True)
        m |= {
            "input_layernorm": Weight(LAYER + "input_layernorm.weight", (L, D)),
            "q_proj": Weight(LAYER + "self_attn.q_proj.weight", (L, D, NH), COLUMNS, transpose=True),
            "k_proj": Weight(LAYER + "self_attn.k_proj.weight", (L, D, KH), COLUMNS, transpose=True),
            "v_proj": Weight(LAYER + "self_attn.v_proj.weight", (L, D, KH), COLUMNS, transpose=True),
            "o_proj": Weight(LAYER + "self_attn.o_proj.weight", (L, NH, D), ROWS, transpose=True),
            "post_attention_layernorm": Weight(LAYER + "post_attention_layernorm.weight", (L, D)),
            "gate_proj": Weight(LAYER + "mlp.gate_proj.weight", (L, D, F), COLUMNS, transpose=True),
            "up_proj": Weight(LAYER + "mlp.up_proj.weight", (L, D, F), COLUMNS, transpose=True),
            "down_proj": Weight(LAYER + "mlp.down_proj.weight", (L, F, D), ROWS, transpose=True),
        }
        if c.attention_bias:
            m |= {
                "q_bias": Weight(LAYER + "self_attn.q_proj.bias", (L, NH), COLUMN_BIAS),
                "k_bias": Weight(LAYER + "self_attn.k_proj.bias", (L, KH), COLUMN_BIAS),
                "v_bias": Weight(LAYER + "self_attn.v_proj.bias", (L, KH), COLUMN_BIAS),
            }
        if c.o_bias:
            m["o_bias"] = Weight(LAYER + "self_attn.o_proj.bias", (L, D))
        if c.mlp_bias:
            m |= {
                "gate_bias": Weight(LAYER + "mlp.gate_proj.bias", (L, F), COLUMN_BIAS),
                "up_bias": Weight(LAYER + "mlp.up_proj.bias", (L, F), COLUMN_BIAS),
                "down_bias": Weight(LAYER + "mlp.down_proj.bias", (L, D)),
            }
        return m

    @classmethod
    def ignored_hf_tensors(cls, config: ModelArchConfig) -> tuple[str, ...]:
        tied_head = (r"lm_head\.weight",) if config.tie_word_embeddings else ()  # a copy of embed_tokens
        return super().ignored_hf_tensors(config) + tied_head

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, param_dtype=None,
                 scan_layers: bool = True, mesh: Mesh | None = None) -> None:
        """weights: our param name -> array of ``weight_map(config)``'s shape (the loader
        passes them placed on the mesh, in ``dtype``). ``param_dtype``: the dtype of the
        matmul weights (``matmul_weight_names``; None: ``dtype``), the activations and
        everything else staying in ``dtype``. ``mesh``: the mesh they are placed on, for
        the parts that run under shard_map (MoE experts); None: one device."""
        self.config = config
        self.scan_layers = scan_layers
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        wm = param_map(type(self), config)
        dtypes = dict.fromkeys(wm, dtype) | dict.fromkeys(matmul_weight_names(wm), param_dtype or dtype)
        self.embed_tokens = make_param("embed_tokens", weights["embed_tokens"], wm["embed_tokens"], config,
                                       dtypes["embed_tokens"])  # [PV, D]
        # bf16 weights under float32 activations, in the layer scan on CPU: kept as their
        # bit patterns (models.quantization.scan_safe) and bitcast back inside the loop.
        bf16_bits = stacked_weights_as_bits(jax.default_backend(), scan_layers, param_dtype, dtype)
        self.layers = DecoderLayers(config, weights, {n: w for n, w in wm.items() if w.per_layer}, dtypes,
                                    bf16_bits=bf16_bits)
        if not scan_layers:
            # Unrolled, each layer reads arrays of its own. Static slices of the stacked
            # arrays inside the program are copied out on XLA:CPU: SmolLM2-sized layers'
            # matmuls were 2-8x slower that way than with separate arrays or under lax.scan.
            names = [n for n, w in wm.items() if w.per_layer]
            self.layers = nnx.List([LayerWeights(self.layers, names, i) for i in range(config.num_hidden_layers)])
        self.norm = make_param("norm", weights["norm"], wm["norm"], config, dtype)  # [D]
        if not config.tie_word_embeddings:
            self.lm_head = make_param("lm_head", weights["lm_head"], wm["lm_head"], config, dtypes["lm_head"])  # [D, PV]
        # Not an nnx.Param: the loader places it replicated and keeps it float32 whatever
        # the params' dtype.
        self.inv_freq = nnx.Variable(jnp.asarray(
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)))
        self.rope_scale = rope_attention_factor(config.rope_scaling, config.max_position_embeddings)

    def norm_qk(self, q, k, lw):
        """Hook between the q/k projections and rope (q: [T, N, H], k: [T, K, H])."""
        return q, k

    def mlp(self, x, lw):
        """The feed-forward of one layer: x [T, D] (normed) -> [T, D]; ``lw``: the layer's
        weights by name. Llama's SiLU-gated MLP; the MoE models override it."""
        gate, up = linear(x, lw, "gate_proj"), linear(x, lw, "up_proj")
        if self.config.mlp_bias:
            gate, up = gate + lw["gate_bias"], up + lw["up_bias"]
        out = linear(jax.nn.silu(gate) * up, lw, "down_proj")
        return out + lw["down_bias"] if self.config.mlp_bias else out

    def norm_fn(self, x, w):
        """The model's RMSNorm (Gemma's scales by 1 + w)."""
        return rms_norm(x, w, self.config.rms_norm_eps)

    def embed(self, input_ids):
        """input_ids [T] -> [T, D] (Gemma scales by sqrt(D))."""
        return self.embed_tokens[...][input_ids].astype(self.dtype)

    def rope_inv_freq(self, layer):
        """The rotary frequencies [H/2] of ``layer`` (Gemma 3: local layers have their own)."""
        return self.inv_freq[...]

    def attention(self, x, kv_cache, lw, layer, positions, md, attention_fn):
        """Self-attention of one layer: x [T, D] (normed) -> ([T, D] after o_proj, kv_cache)."""
        c = self.config
        t = x.shape[0]
        N, K, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, k, v = linear(x, lw, "q_proj"), linear(x, lw, "k_proj"), linear(x, lw, "v_proj")
        if c.attention_bias:
            q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
        q, k, v = q.reshape(t, N, H), k.reshape(t, K, H), v.reshape(t, K, H)
        q, k = self.norm_qk(q, k, lw)
        inv_freq = self.rope_inv_freq(layer)
        q = apply_rope(q, positions, inv_freq, self.rope_scale, c.mrope_section)
        k = apply_rope(k, positions, inv_freq, self.rope_scale, c.mrope_section)
        # GPT-OSS's sinks: one logit per head in each softmax (pallas_kernels/backend.py).
        sinks = {"sinks": lw["sinks"].astype(jnp.float32)} if c.attention_sinks else {}
        o, kv_cache = attention_fn(q, k, v, kv_cache, layer, md, **sinks)
        attn = linear(o.reshape(t, N * H), lw, "o_proj")
        if c.o_bias:
            attn = attn + lw["o_bias"]
        return attn, kv_cache

    def decoder_layer(self, h, kv_cache, lw, layer, positions, md, attention_fn):
        """One pre-norm decoder layer: h [T, D] -> (h, kv_cache)."""
        attn, kv_cache = self.attention(self.norm_fn(h, lw["input_layernorm"]), kv_cache, lw, layer, positions, md,
                                        attention_fn)
        h = h + attn
        return h + self.mlp(self.norm_fn(h, lw["post_attention_layernorm"]), lw), kv_cache

    def __call__(self, input_ids, positions, kv_cache, md: AttentionMetadata, attention_fn: Callable, lora=None,
                 mm=None):
        """input_ids, positions: [T] int32 (positions [3, T] under M-RoPE, Qwen2-VL);
        kv_cache: [L, P, S, 2K, H].
        attention_fn(q, k, v, kv_cache, layer, md) -> (o [T, N, H], kv_cache).
        lora: None, or the LoRA adapters of the step (models/lora.py): (buffers
        {projection: (a [L, in, S*R], b [L, S*R, out])}, mask [T, S*R], on: bool scalar).
        mm: None, or the images' embeddings that replace their placeholder tokens'
        (the runner's encoder-output buffer [E, D], and each token's row of it [T], -1
        for a text token).
        Returns (hidden [T, D] after the final norm, kv_cache)."""
        c = self.config
        h = self.embed(input_ids)
        if mm is not None:
            embeds, rows = mm
            h = jnp.where((rows >= 0)[:, None], embeds[jnp.maximum(rows, 0)].astype(h.dtype), h)
        names = [n for n, w in param_map(type(self), c).items() if w.per_layer]
        lora_layers, lora_step = lora_inputs(lora, h.dtype)

        def layer_fn(h, kv_cache, lw, layer):
            return self.decoder_layer(h, kv_cache, lw | lora_step, layer, positions, md, attention_fn)

        if self.scan_layers:
            stacked = {n: getattr(self.layers, n)[...] for n in names} | lora_layers
            h, kv_cache = scan_layers(layer_fn, h, kv_cache, stacked, 0, c.num_hidden_layers)
        else:
            for i, weights in enumerate(self.layers):
                lw = {n: getattr(weights, n)[...] for n in names} | {n: x[i] for n, x in lora_layers.items()}
                h, kv_cache = layer_fn(h, kv_cache, lw, i)
        return self.norm_fn(h, self.norm[...]), kv_cache

    def pool_head(self, pooled):
        """pooled [R, D] -> what a pooling request returns before its host-side
        normalization (float32): the pooled state itself (an embedding model; the
        classifiers of models/adapters.py apply their score head)."""
        return pooled.astype(jnp.float32)

    def compute_logits(self, hidden):
        """hidden: [R, D] -> logits [R, V] in float32, the real vocabulary only: the
        padding rows' logits are cut off here, so a padded id is never sampled and never
        appears in logprobs."""
        c = self.config
        if c.tie_word_embeddings:
            logits = matmul(hidden, self.embed_tokens[...], transposed=True)
        else:
            logits = matmul(hidden, self.lm_head[...])
        return logits[:, :c.vocab_size].astype(jnp.float32)
