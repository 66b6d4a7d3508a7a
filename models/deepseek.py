"""DeepSeek-V2 / V3 (and their MLA relatives): the Llama decoder with

- **Multi-head Latent Attention.** Each token's keys and values come from one latent
  ``c = norm(x @ W_kv_a)[:R]`` (R = kv_lora_rank) and one rope key ``k_pe`` shared by
  every head (H_r = qk_rope_head_dim); only [c, k_pe] is cached, one row of R + H_r per
  token per layer (the latent KV layout: [L, P, S, 1, R + H_r], pallas_kernels/backend.py).
  Attention runs *absorbed*: head n's key is ``c @ W_uk[n]`` and its value ``c @ W_uv[n]``
  (kv_b_proj), so ``q_nope . k_nope = (q_nope @ W_uk[n]^T) . c`` and the query becomes
  [q_nope W_uk[n]^T, q_pe] against the cached row itself, which is also the value; the
  output's first R entries times W_uv[n] are the head's output. Every token of every step
  (prefill and decode) goes this way, so the kernels see one KV head of R + H_r and
  chunked prefill and prefix hits read the same latent rows.
- q either one projection (V2-Lite) or a low-rank pair with its norm (q_a / q_b);
  rope on pairs (x0, x1), (x2, x3), ... (``rope_interleave``: V2 always, V3 by config),
  YaRN with its mscale folded into the softmax scale (``softmax_scale``).
- MoE from layer ``first_k_dense_replace`` on (the first layers have a dense MLP): the
  group-limited routing (models/moe.py: GroupedRouting; V2 softmax / V3 sigmoid with
  ``e_score_correction_bias``), weights scaled by routed_scaling_factor, and the
  always-on shared experts added.

The dense and MoE layers are two stacks (their weights differ in kind), each run under its
own layer scan; the attention weights are one stack of every layer, sliced per scan.
Tensor parallel splits the heads (q, kv_b, o) and the MLPs; the latent projection, its
norm and the cache are whole on every device. Expert parallel splits the experts.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from models.base import MODEL, Weight
from models.config import ModelArchConfig, hf_common_fields
from models.llama import COLUMNS, LAYER, ROWS, LlamaForCausalLM, lora_inputs, scan_layers
from models.lora import LORA_A, LORA_B, LORA_MASK, LORA_ON
from models.moe import GroupedRouting, expert_stacks, moe_arch_fields, moe_block
from models.quantization import linear, param_map, scan_safe
from models.rope import apply_rope

_L, _LD, _LS = "num_hidden_layers", "dense_layers", "sparse_layers"
_D, _F, _E, _FE, _FS = "hidden_size", "intermediate_size", "num_experts", "moe_intermediate_size", \
    "shared_expert_intermediate_size"
_Q = "num_attention_heads*qk_head_dim"
_KV_A = "kv_lora_rank+head_dim"  # the latent and the rope key (head_dim: the rope dims)
_KV_B = "num_attention_heads*qk_nope_head_dim+num_attention_heads*v_head_dim"
_O = "num_attention_heads*v_head_dim"
_EXPERTS = ("experts_gate", "experts_up", "experts_down")


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction (DeepSeek's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass
class KvBAdapter:
    """The LoRA adapters of kv_b_proj, applied in the absorbed form. An adapter changes
    head n's key and value of latent c by ``((c @ a) * mask) @ b[:, n]`` (a [R, S*Rk],
    b [S*Rk, N, nope + v]: models/lora.py's buffers, the token's own slot kept by
    ``mask`` [T, S*Rk]); every key of a request has its queries' adapter, so
    ``q_nope . k`` gains ``c . (a @ (mask * (b_k[:, n] @ q_nope)))``: a term of the
    absorbed query, and the output ``o_latent @ W_uv[n]`` gains ``((o_latent @ a) *
    mask) @ b_v[:, n]``. The latent cache stays the adapter-free latent."""

    a: jax.Array  # [R, S*Rk]
    b_k: jax.Array  # [S*Rk, N, nope]
    b_v: jax.Array  # [S*Rk, N, v]
    mask: jax.Array  # [T, S*Rk]
    on: jax.Array  # bool scalar: any token of the step has an adapter

    def absorb_query(self, q_nope, q_latent):
        """q_nope [T, N, nope], q_latent [T, N, R] -> q_latent with the adapters' term."""
        def add():
            t = jnp.einsum("tnd,knd->tnk", q_nope, self.b_k.astype(q_nope.dtype)) * self.mask[:, None]
            return q_latent + jnp.einsum("tnk,rk->tnr", t, self.a.astype(t.dtype))
        return jax.lax.cond(self.on, add, lambda: q_latent)

    def absorb_output(self, o_latent, out):
        """o_latent [T, N, R], out [T, N, v] -> out with the adapters' values."""
        def add():
            t = jnp.einsum("tnr,rk->tnk", o_latent, self.a.astype(o_latent.dtype)) * self.mask[:, None]
            return out + jnp.einsum("tnk,knv->tnv", t, self.b_v.astype(t.dtype))
        return jax.lax.cond(self.on, add, lambda: out)


def kv_b_adapter(lw: dict, heads: int, nope: int) -> KvBAdapter | None:
    """The layer's kv_b_proj adapters (``lw`` with LoRA buffers of kv_b_proj), or None."""
    a = lw.get("kv_b_proj" + LORA_A)
    if a is None:
        return None
    b = lw["kv_b_proj" + LORA_B]
    b = b.reshape(b.shape[0], heads, -1)
    mask = lw[LORA_MASK].astype(a.dtype)
    return KvBAdapter(a, b[..., :nope], b[..., nope:], mask, lw[LORA_ON])


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    architectures = ("DeepseekV2ForCausalLM",)
    version = 2

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        name = cfg["architectures"][0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{name}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        if cfg.get("attention_bias"):
            raise ValueError(f"{name}: attention_bias=true is not supported")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"{name}: moe_layer_freq={cfg['moe_layer_freq']} is not supported (1: every layer "
                             "from first_k_dense_replace on)")
        rope = cfg.get("qk_rope_head_dim")
        if not rope or rope % 2:
            raise ValueError(f"{name}: qk_rope_head_dim must be a positive even number, got {rope!r}")
        layers, dense = cfg["num_hidden_layers"], int(cfg.get("first_k_dense_replace") or 0)
        if not 0 <= dense <= layers:
            raise ValueError(f"{name}: first_k_dense_replace must be in [0, {layers}], got {dense}")
        heads = cfg["num_attention_heads"]
        nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        common = hf_common_fields({**cfg, "head_dim": rope, "num_key_value_heads": heads})
        scale = (nope + rope) ** -0.5
        rp = common["rope_scaling"]
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            scale *= _mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
        experts = cfg.get("n_routed_experts") or 0
        moe = {}
        if dense < layers:
            if not experts:
                raise ValueError(f"{name}: n_routed_experts must be positive when there are MoE layers")
            v3 = cls.version == 3
            method = "noaux_tc" if v3 else cfg.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ValueError(f"{name}: topk_method {method!r} is not supported (greedy, group_limited_greedy, "
                                 "noaux_tc)")
            groups = int(cfg.get("n_group") or 1) if method != "greedy" else 1
            topk_group = int(cfg.get("topk_group") or 1) if groups > 1 else 1
            if experts % groups or not 1 <= topk_group <= groups:
                raise ValueError(f"{name}: n_group={groups} must divide n_routed_experts={experts} and topk_group "
                                 f"must be in [1, {groups}], got {topk_group}")
            moe = moe_arch_fields(cfg, num_experts=experts, moe_intermediate_size=cfg["moe_intermediate_size"],
                                  norm_topk_prob=bool(cfg.get("norm_topk_prob")) and v3)
            moe |= dict(n_group=groups, topk_group=topk_group, scoring_func="sigmoid" if v3 else "softmax",
                        group_score="top2" if v3 else "max", score_correction_bias=v3,
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        shared_expert_intermediate_size=cfg["moe_intermediate_size"] * int(
                            cfg.get("n_shared_experts") or 0))
        return ModelArchConfig(
            **common, **moe, kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_nope_head_dim=nope, qk_head_dim=nope + rope, v_head_dim=v, softmax_scale=scale,
            rope_interleave=bool(cfg.get("rope_interleave", True)) if cls.version == 3 else True,
            dense_layers=dense, sparse_layers=layers - dense)

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        m = {
            "embed_tokens": Weight("model.embed_tokens.weight", ("padded_vocab_size", _D), (MODEL, None)),
            "norm": Weight("model.norm.weight", (_D,)),
            "input_layernorm": Weight(LAYER + "input_layernorm.weight", (_L, _D)),
            "post_attention_layernorm": Weight(LAYER + "post_attention_layernorm.weight", (_L, _D)),
            "kv_a_proj": Weight(LAYER + "self_attn.kv_a_proj_with_mqa.weight", (_L, _D, _KV_A), transpose=True),
            "kv_a_layernorm": Weight(LAYER + "self_attn.kv_a_layernorm.weight", (_L, "kv_lora_rank")),
            # [R, N (nope + v)]: head n's W_uk and W_uv side by side; used as a tensor (absorbed), never x @ w.
            "kv_b_proj": Weight(LAYER + "self_attn.kv_b_proj.weight", (_L, "kv_lora_rank", _KV_B), COLUMNS,
                                transpose=True),
            "o_proj": Weight(LAYER + "self_attn.o_proj.weight", (_L, _O, _D), ROWS, transpose=True),
        }
        if not c.tie_word_embeddings:
            m["lm_head"] = Weight("lm_head.weight", (_D, "padded_vocab_size"), (None, MODEL), transpose=True)
        if c.q_lora_rank:
            m |= {
                "q_a_proj": Weight(LAYER + "self_attn.q_a_proj.weight", (_L, _D, "q_lora_rank"), transpose=True),
                "q_a_layernorm": Weight(LAYER + "self_attn.q_a_layernorm.weight", (_L, "q_lora_rank")),
                "q_b_proj": Weight(LAYER + "self_attn.q_b_proj.weight", (_L, "q_lora_rank", _Q), COLUMNS,
                                   transpose=True),
            }
        else:
            m["q_proj"] = Weight(LAYER + "self_attn.q_proj.weight", (_L, _D, _Q), COLUMNS, transpose=True)
        if c.dense_layers:  # layers 0 .. first_k_dense_replace - 1
            cols, rows = (None, None, MODEL), (None, MODEL, None)
            m |= {
                "dense_gate": Weight(LAYER + "mlp.gate_proj.weight", (_LD, _D, _F), cols, transpose=True),
                "dense_up": Weight(LAYER + "mlp.up_proj.weight", (_LD, _D, _F), cols, transpose=True),
                "dense_down": Weight(LAYER + "mlp.down_proj.weight", (_LD, _F, _D), rows, transpose=True),
            }
        if c.sparse_layers:  # the rest, stacked from checkpoint layer first_k_dense_replace on
            at = dict(layer_offset=_LD)
            if c.expert_parallel:
                ecols = erows = (None, MODEL, None, None)
            else:
                ecols, erows = (None, None, None, MODEL), (None, None, MODEL, None)
            expert = LAYER + "mlp.experts.{e}."
            m |= {
                "router": Weight(LAYER + "mlp.gate.weight", (_LS, _D, _E), transpose=True, **at),
                "experts_gate": Weight(expert + "gate_proj.weight", (_LS, _E, _D, _FE), ecols, transpose=True, **at),
                "experts_up": Weight(expert + "up_proj.weight", (_LS, _E, _D, _FE), ecols, transpose=True, **at),
                "experts_down": Weight(expert + "down_proj.weight", (_LS, _E, _FE, _D), erows, transpose=True, **at),
            }
            if c.score_correction_bias:
                m["score_bias"] = Weight(LAYER + "mlp.gate.e_score_correction_bias", (_LS, _E), **at)
            if c.shared_expert_intermediate_size:
                cols, rows = (None, None, MODEL), (None, MODEL, None)
                shared = LAYER + "mlp.shared_experts."
                m |= {
                    "shared_gate": Weight(shared + "gate_proj.weight", (_LS, _D, _FS), cols, transpose=True, **at),
                    "shared_up": Weight(shared + "up_proj.weight", (_LS, _D, _FS), cols, transpose=True, **at),
                    "shared_down": Weight(shared + "down_proj.weight", (_LS, _FS, _D), rows, transpose=True, **at),
                }
        return m

    @classmethod
    def ignored_hf_tensors(cls, config: ModelArchConfig) -> tuple[str, ...]:
        # V3's multi-token-prediction layers follow the last decoder layer (layer 61 of
        # 61): speculative-decoding weights this decoder does not run.
        mtp = "|".join(str(config.num_hidden_layers + i) for i in range(4))
        return super().ignored_hf_tensors(config) + (rf"model\.layers\.(?:{mtp})\..*",)

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, param_dtype=None,
                 scan_layers: bool = True, mesh=None) -> None:
        # The stacks stay stacked: unrolled (scan_layers False), each layer takes static slices.
        super().__init__(config, weights, dtype=dtype, param_dtype=param_dtype, scan_layers=True, mesh=mesh)
        self.scan_layers = scan_layers
        self.routing = GroupedRouting(
            scoring=config.scoring_func, n_group=config.n_group, topk_group=config.topk_group,
            group_score=config.group_score, mask_value=-jnp.inf if config.scoring_func == "sigmoid" else 0.0,
            normalize=config.norm_topk_prob, scale=config.routed_scaling_factor)

    def rope(self, x, positions):
        """Rope on x [T, heads, H_r], pairs interleaved when the model says so (the
        de-interleaved layout HF's V3 returns; q and k alike, so the scores are the same)."""
        if self.config.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, positions, self.inv_freq[...], self.rope_scale)

    def attention(self, x, kv_cache, lw, layer, positions, md, attention_fn):
        c = self.config
        t = x.shape[0]
        n, r, nope, vd = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        if c.q_lora_rank:
            q = linear(self.norm_fn(linear(x, lw, "q_a_proj"), lw["q_a_layernorm"]), lw, "q_b_proj")
        else:
            q = linear(x, lw, "q_proj")
        q = q.reshape(t, n, c.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv_a = linear(x, lw, "kv_a_proj")  # [T, R + H_r]
        latent = self.norm_fn(kv_a[:, :r], lw["kv_a_layernorm"])
        k_pe = self.rope(kv_a[:, None, r:], positions)  # [T, 1, H_r]
        q_pe = self.rope(q_pe, positions)
        w_b = lw["kv_b_proj"].reshape(r, n, nope + vd)  # [R, N, nope + v]
        w_uk, w_uv = w_b[..., :nope], w_b[..., nope:]
        q_latent = jnp.einsum("tnd,rnd->tnr", q_nope, w_uk.astype(q_nope.dtype))
        adapter = kv_b_adapter(lw, n, nope)
        if adapter is not None:
            q_latent = adapter.absorb_query(q_nope, q_latent)
        query = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)  # [T, N, R + H_r]
        row = jnp.concatenate([latent, k_pe[:, 0].astype(latent.dtype)], axis=-1)[:, None]  # [T, 1, R + H_r]
        o, kv_cache = attention_fn(query, row, None, kv_cache, layer, md)
        out = jnp.einsum("tnr,rnv->tnv", o[..., :r], w_uv.astype(o.dtype))  # [T, N, v]
        if adapter is not None:
            out = adapter.absorb_output(o[..., :r], out)
        return linear(out.reshape(t, n * vd), lw, "o_proj"), kv_cache

    def mlp(self, x, lw):
        c = self.config
        if "dense_gate" in lw:
            return linear(jax.nn.silu(linear(x, lw, "dense_gate")) * linear(x, lw, "dense_up"), lw, "dense_down")
        weights, scales = expert_stacks(lw, _EXPERTS, x.dtype)
        out = moe_block(x, lw["router"], weights, scales, top_k=c.num_experts_per_tok,
                        normalize=c.norm_topk_prob, mesh=self.mesh, expert_parallel=c.expert_parallel,
                        routing=self.routing, score_bias=lw.get("score_bias"))
        if c.shared_expert_intermediate_size:
            out = out + linear(jax.nn.silu(linear(x, lw, "shared_gate")) * linear(x, lw, "shared_up"), lw,
                               "shared_down")
        return out

    def __call__(self, input_ids, positions, kv_cache, md, attention_fn, lora=None):
        """As LlamaForCausalLM's; the dense layers' scan, then the MoE layers'."""
        c = self.config
        h = self.embed(input_ids)
        wm = param_map(type(self), c)
        names = [n for n, w in wm.items() if w.per_layer]
        lora_layers, lora_step = lora_inputs(lora, h.dtype)
        every = {n: getattr(self.layers, n)[...] for n in names if wm[n].dims[0] == _L} | lora_layers
        for start, stop, kind in ((0, c.dense_layers, _LD), (c.dense_layers, c.num_hidden_layers, _LS)):
            if start == stop:
                continue
            stacked = {n: x[start:stop] for n, x in every.items()}
            stacked |= {n: getattr(self.layers, n)[...] for n in names if wm[n].dims[0] == kind}

            def layer_fn(h, kv, lw, layer):
                return self.decoder_layer(h, kv, lw | lora_step, layer, positions, md, attention_fn)

            if self.scan_layers:
                h, kv_cache = scan_layers(layer_fn, h, kv_cache, stacked, start, stop)
            else:
                for i in range(stop - start):
                    lw = scan_safe({n: x[i] for n, x in stacked.items()}, restore=True)
                    h, kv_cache = layer_fn(h, kv_cache, lw, start + i)
        return self.norm_fn(h, self.norm[...]), kv_cache


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    architectures = ("DeepseekV3ForCausalLM",)
    version = 3

