"""BERT-family encoders (BertModel, XLMRobertaModel; BertForSequenceClassification and
XLMRobertaForSequenceClassification as cross-encoders) for the pooling runner
(docs/pooling.md).

An encoder attends both ways within its own input, so a request's whole prompt runs in
one step (the engine turns chunked prefill off for encoders) and nothing is written to
or read from the KV cache: attention is computed here, densely, over each request's own
tokens of the step's ragged batch (``segment_attention``). Absolute position embeddings
(XLM-R's start at padding_idx + 1), post-layer-norm, GELU (erf). ``rms_norm_eps``
holds the config's layer_norm_eps.

Token types (BERT's segment ids: 0 for a pair's first text, 1 for its second) ride in
the token ids, ``id | type << TOKEN_TYPE_SHIFT`` (``pack_token_types``), so the step's
inputs stay one int32 array (vLLM's encoding): the engine packs a pair prompt's types
when the model has more than one, and the embedding splits them again.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.base import MODEL, CausalLM, Weight, make_param
from models.config import ModelArchConfig
from models.llama import COLUMN_BIAS, COLUMNS, ROWS, DecoderLayers
from models.quantization import linear, matmul_weight_names, param_map, scan_safe
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.storage import stacked_weights_as_bits

L, D, F, V = "num_hidden_layers", "hidden_size", "intermediate_size", "padded_vocab_size"
NH = "num_attention_heads*head_dim"
LAYER = "encoder.layer.{i}."
QUERY_BLOCK = 256  # queries per block of segment_attention
TOKEN_TYPE_SHIFT = 30  # above any vocabulary; type 1 still fits an int32


def pack_token_types(ids: list[int], token_type_ids: list[int]) -> list[int]:
    """Token ids with their token types in the high bits (the step's input ids)."""
    return [i | (t << TOKEN_TYPE_SHIFT) for i, t in zip(ids, token_type_ids, strict=True)]


def layer_norm(x, w, b, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def segment_attention(q, k, v, query_start_loc, num_seqs, *, max_len: int, scale: float):
    """Bidirectional attention of each request over its own tokens of a ragged batch:
    q, k, v [T, N, H]; query_start_loc [Rmax + 1] (past the requests, the total) ->
    [T, N, H]. Queries go in blocks of up to QUERY_BLOCK; a block's keys are the window
    max_len - 1 tokens either side of it (a request is at most max_len long), so the
    work is T * (block + 2 max_len), not T^2. Padding tokens attend to nothing (zeros)."""
    t, n, h = q.shape
    seg = jnp.searchsorted(query_start_loc[1:], jnp.arange(t), side="right")  # padding: >= num_seqs
    seg = jnp.where(seg < num_seqs, seg, -1)
    qb = min(t, QUERY_BLOCK)
    nb = -(-t // qb)
    pad_q = nb * qb - t
    w = min(max_len - 1, t)  # keys either side of a block
    kp = jnp.pad(k, ((w, w + pad_q), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((w, w + pad_q), (0, 0), (0, 0)))
    seg_k = jnp.pad(seg, (w, w + pad_q), constant_values=-2)
    qp = jnp.pad(q, ((0, pad_q), (0, 0), (0, 0))).reshape(nb, qb, n, h)
    seg_q = jnp.pad(seg, (0, pad_q), constant_values=-1).reshape(nb, qb)

    def block(args):
        i, qi, sq = args
        start = i * qb  # in the padded keys, the window of queries [start, start + qb)
        ki = jax.lax.dynamic_slice_in_dim(kp, start, qb + 2 * w)
        vi = jax.lax.dynamic_slice_in_dim(vp, start, qb + 2 * w)
        sk = jax.lax.dynamic_slice_in_dim(seg_k, start, qb + 2 * w)
        scores = jnp.einsum("qnh,knh->nqk", qi.astype(jnp.float32), ki.astype(jnp.float32)) * scale
        mask = (sq[:, None] == sk[None, :]) & (sq[:, None] >= 0)
        scores = jnp.where(mask[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[None], probs, 0.0)  # rows with no key (padding) are zeros, not NaN
        return jnp.einsum("nqk,knh->qnh", probs, vi.astype(jnp.float32)).astype(q.dtype)

    out = jax.lax.map(block, (jnp.arange(nb), qp, seg_q))
    return out.reshape(nb * qb, n, h)[:t]


class BertModel(CausalLM):
    """The encoder; the embedding models' outputs are its last hidden states."""

    architectures = ("BertModel",)
    prefix = ""  # the checkpoint's name prefix ("bert." in a BertFor* checkpoint)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (gelu only)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported "
                             "(absolute only)")
        heads = cfg["num_attention_heads"]
        offset = cfg.get("pad_token_id", 1) + 1 if cfg.get("model_type") in ("xlm-roberta", "roberta") else 0
        return ModelArchConfig(
            architecture=cfg["architectures"][0], vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("layer_norm_eps", 1e-12), rope_theta=10000.0,
            # The positions a request may use: the table less the offset.
            max_position_embeddings=cfg["max_position_embeddings"] - offset, tie_word_embeddings=True,
            type_vocab_size=cfg.get("type_vocab_size", 2), position_offset=offset,
            num_position_embeddings=cfg["max_position_embeddings"],
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=[])

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        e, lay = cls.prefix + "embeddings.", cls.prefix + LAYER
        return {
            "embed_tokens": Weight(e + "word_embeddings.weight", (V, D), (MODEL, None)),
            "position_embeddings": Weight(e + "position_embeddings.weight", ("num_position_embeddings", D)),
            "token_type_embeddings": Weight(e + "token_type_embeddings.weight", ("type_vocab_size", D)),
            "embed_norm": Weight(e + "LayerNorm.weight", (D,)),
            "embed_norm_bias": Weight(e + "LayerNorm.bias", (D,)),
            "q_proj": Weight(lay + "attention.self.query.weight", (L, D, NH), COLUMNS, transpose=True),
            "q_bias": Weight(lay + "attention.self.query.bias", (L, NH), COLUMN_BIAS),
            "k_proj": Weight(lay + "attention.self.key.weight", (L, D, NH), COLUMNS, transpose=True),
            "k_bias": Weight(lay + "attention.self.key.bias", (L, NH), COLUMN_BIAS),
            "v_proj": Weight(lay + "attention.self.value.weight", (L, D, NH), COLUMNS, transpose=True),
            "v_bias": Weight(lay + "attention.self.value.bias", (L, NH), COLUMN_BIAS),
            "o_proj": Weight(lay + "attention.output.dense.weight", (L, NH, D), ROWS, transpose=True),
            "o_bias": Weight(lay + "attention.output.dense.bias", (L, D)),
            "attn_norm": Weight(lay + "attention.output.LayerNorm.weight", (L, D)),
            "attn_norm_bias": Weight(lay + "attention.output.LayerNorm.bias", (L, D)),
            "up_proj": Weight(lay + "intermediate.dense.weight", (L, D, F), COLUMNS, transpose=True),
            "up_bias": Weight(lay + "intermediate.dense.bias", (L, F), COLUMN_BIAS),
            "down_proj": Weight(lay + "output.dense.weight", (L, F, D), ROWS, transpose=True),
            "down_bias": Weight(lay + "output.dense.bias", (L, D)),
            "out_norm": Weight(lay + "output.LayerNorm.weight", (L, D)),
            "out_norm_bias": Weight(lay + "output.LayerNorm.bias", (L, D)),
        }

    @classmethod
    def ignored_hf_tensors(cls, config: ModelArchConfig) -> tuple[str, ...]:
        # BertModel's pooler (dense + tanh on [CLS]) is not what sentence-transformers pools.
        return super().ignored_hf_tensors(config) + (r".*pooler\.dense\..*", r".*embeddings\.position_ids")

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, param_dtype=None,
                 scan_layers: bool = True, mesh: Mesh | None = None) -> None:
        self.config, self.scan_layers, self.mesh, self.dtype = config, True, mesh, jnp.dtype(dtype)
        wm = param_map(type(self), config)
        dtypes = dict.fromkeys(wm, dtype) | dict.fromkeys(matmul_weight_names(wm), param_dtype or dtype)
        for name, w in wm.items():
            if not w.per_layer:
                setattr(self, name, make_param(name, weights[name], w, config, dtypes[name]))
        bf16_bits = stacked_weights_as_bits(jax.default_backend(), True, param_dtype, dtype)
        self.layers = DecoderLayers(config, weights, {n: w for n, w in wm.items() if w.per_layer}, dtypes,
                                    bf16_bits=bf16_bits)

    def encoder_layer(self, h, lw, md: AttentionMetadata):
        c = self.config
        t, n, hd = h.shape[0], c.num_attention_heads, c.head_dim
        q = (linear(h, lw, "q_proj") + lw["q_bias"]).reshape(t, n, hd)
        k = (linear(h, lw, "k_proj") + lw["k_bias"]).reshape(t, n, hd)
        v = (linear(h, lw, "v_proj") + lw["v_bias"]).reshape(t, n, hd)
        o = segment_attention(q, k, v, md.query_start_loc, md.num_seqs[0], max_len=c.max_position_embeddings,
                              scale=hd ** -0.5)
        attn = linear(o.reshape(t, n * hd), lw, "o_proj") + lw["o_bias"]
        h = layer_norm(h + attn, lw["attn_norm"], lw["attn_norm_bias"], c.rms_norm_eps)
        ff = jax.nn.gelu(linear(h, lw, "up_proj") + lw["up_bias"], approximate=False)
        ff = linear(ff, lw, "down_proj") + lw["down_bias"]
        return layer_norm(h + ff, lw["out_norm"], lw["out_norm_bias"], c.rms_norm_eps)

    def __call__(self, input_ids, positions, kv_cache, md: AttentionMetadata, attention_fn: Callable, lora=None):
        """As the decoders' (models/llama.py), with no KV cache use: kv_cache comes back
        as it came. Returns (the last hidden states [T, D], kv_cache)."""
        c = self.config
        types = input_ids >> TOKEN_TYPE_SHIFT  # 0 unless the engine packed a pair's types
        input_ids = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        h = (self.embed_tokens[...][input_ids].astype(jnp.float32)
             + self.position_embeddings[...][positions + c.position_offset].astype(jnp.float32)
             + self.token_type_embeddings[...][jnp.minimum(types, c.type_vocab_size - 1)].astype(jnp.float32))
        h = layer_norm(h, self.embed_norm[...], self.embed_norm_bias[...], c.rms_norm_eps).astype(self.dtype)
        names = [n for n, w in param_map(type(self), c).items() if w.per_layer]
        stacked = {n: getattr(self.layers, n)[...] for n in names}

        def body(h, lw):
            return self.encoder_layer(h, scan_safe(lw, restore=True), md), None

        h, _ = jax.lax.scan(body, h, stacked)
        return h, kv_cache

    def pool_head(self, pooled):
        return pooled.astype(jnp.float32)

    def compute_logits(self, hidden):
        raise ValueError(f"{self.config.architecture} is an encoder: it pools, it has no logits")


class XLMRobertaModel(BertModel):
    architectures = ("XLMRobertaModel",)


class _SequenceClassifier(BertModel):
    """A cross-encoder's head on the first token's state: ``score(tanh(dense(h[0])))``,
    with the checkpoint names of HEAD (dense weight, dense bias, score weight, score bias)."""

    HEAD: tuple[str, str, str, str]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        from models.adapters import num_labels

        return dataclasses.replace(super().from_hf_config(cfg), num_labels=num_labels(cfg))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        dw, db, sw, sb = cls.HEAD
        return super().weight_map(c) | {
            "head_dense": Weight(dw, (D, D), transpose=True),
            "head_dense_bias": Weight(db, (D,)),
            "score": Weight(sw, (D, "num_labels"), transpose=True),
            "score_bias": Weight(sb, ("num_labels",)),
        }

    def __init__(self, config: ModelArchConfig, weights: dict, **kwargs) -> None:
        super().__init__(config, weights, **kwargs)
        wm = param_map(type(self), config)
        for name in ("head_dense", "head_dense_bias", "score", "score_bias"):  # float32: small, compared
            setattr(self, name, make_param(name, weights[name], wm[name], config, jnp.float32))

    def pool_head(self, pooled):
        x = jnp.tanh(pooled.astype(jnp.float32) @ self.head_dense[...] + self.head_dense_bias[...])
        return x @ self.score[...] + self.score_bias[...]


class BertForSequenceClassification(_SequenceClassifier):
    """A BERT cross-encoder (ms-marco MiniLM style): BERT's pooler (dense + tanh on
    [CLS]), then the classifier. Pooled with CLS; pairs carry their token types."""

    architectures = ("BertForSequenceClassification",)
    prefix = "bert."
    HEAD = ("bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias")

    @classmethod
    def ignored_hf_tensors(cls, config: ModelArchConfig) -> tuple[str, ...]:
        # The pooler is this head's first half: keep it (BertModel drops it).
        return tuple(p for p in super().ignored_hf_tensors(config) if "pooler" not in p)


class XLMRobertaForSequenceClassification(_SequenceClassifier):
    """A cross-encoder (bge-reranker style): RoBERTa's classification head on the first
    token: out_proj(tanh(dense(h[0]))). Pooled with CLS."""

    architectures = ("XLMRobertaForSequenceClassification",)
    prefix = "roberta."
    HEAD = ("classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
            "classifier.out_proj.bias")
