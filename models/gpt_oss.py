"""GPT-OSS (gpt-oss-20b / -120b): the Llama decoder with

- attention sinks: a learned logit per query head that joins every softmax's
  denominator and attends to nothing (``self_attn.sinks``, passed to the kernels);
- q/k/v/o biases, sliding-window (128) and full layers alternating (``layer_types``; the
  KV cache groups as Gemma's), YaRN rope;
- a sparse MoE block in every layer (models/moe.py) whose router and experts carry
  biases, top-k of the router logits then their softmax (the same weights as softmax,
  top-k, renormalise), and the clamped SwiGLU ``(up + 1) * gate * sigmoid(1.702 gate)``.

The experts are stored as HF keeps them: ``mlp.experts.gate_up_proj`` [E, D, 2F] with
gate and up interleaved column by column (read with ``Weight.fused_stride`` 2, so each
device reads its own columns), ``down_proj`` [E, F, D], already [in, out]. OpenAI's
checkpoints ship them as MXFP4 (``*_blocks`` / ``*_scales``): the checkpoint reader
presents each pair as that tensor (models/weights.py), decoded on CPU as it is read.
"""
from __future__ import annotations

from models.base import MODEL, Weight
from models.config import ModelArchConfig
from models.gemma2 import layer_types
from models.llama import LAYER, LlamaForCausalLM
from models.moe import _DENSE_MLP, expert_stacks, moe_arch_fields, moe_block

_L, _D, _E, _FE = "num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size"
_GATE_UP = LAYER + "mlp.experts.gate_up_proj"
_EXPERTS = ("experts_gate", "experts_up", "experts_down")


class GptOssForCausalLM(LlamaForCausalLM):
    architectures = ("GptOssForCausalLM",)

    @classmethod
    def arch_fields(cls, cfg: dict) -> dict:
        method = (cfg.get("quantization_config") or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"GptOssForCausalLM: {method!r}-quantized checkpoints are not supported (mxfp4 "
                             "experts, as OpenAI ships them, or bf16)")
        window = cfg.get("sliding_window")
        types = layer_types(cfg, 2)  # without layer_types: even layers slide, odd ones are full
        bias = bool(cfg.get("attention_bias", True))
        moe = moe_arch_fields(cfg, num_experts=cfg.get("num_local_experts"),
                              moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        return moe | dict(
            attention_bias=bias, o_bias=bias, sliding_window=window,
            sliding_window_layers=tuple(t == "sliding_attention" for t in types) if window else None,
            attention_sinks=True, moe_bias=True,
            swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        m = {n: w for n, w in super().weight_map(c).items() if n not in _DENSE_MLP}
        if c.expert_parallel:  # whole experts per device
            cols = rows = (None, MODEL, None, None)
            col_bias = out_bias = (None, MODEL, None)
        else:  # every expert split by its mlp dim, as a dense MLP
            cols, rows = (None, None, None, MODEL), (None, None, MODEL, None)
            col_bias, out_bias = (None, None, MODEL), None
        fused = dict(fused_rows=f"2*{_FE}", fused_stride=2)
        return m | {
            "sinks": Weight(LAYER + "self_attn.sinks", (_L, "num_attention_heads"), (None, MODEL)),
            "router": Weight(LAYER + "mlp.router.weight", (_L, _D, _E), transpose=True),
            "router_bias": Weight(LAYER + "mlp.router.bias", (_L, _E)),
            "experts_gate": Weight(_GATE_UP, (_L, _E, _D, _FE), cols, row_offset="0", **fused),
            "experts_up": Weight(_GATE_UP, (_L, _E, _D, _FE), cols, row_offset="1", **fused),
            "experts_down": Weight(LAYER + "mlp.experts.down_proj", (_L, _E, _FE, _D), rows),
            "experts_gate_bias": Weight(_GATE_UP + "_bias", (_L, _E, _FE), col_bias, row_offset="0", **fused),
            "experts_up_bias": Weight(_GATE_UP + "_bias", (_L, _E, _FE), col_bias, row_offset="1", **fused),
            "experts_down_bias": Weight(LAYER + "mlp.experts.down_proj_bias", (_L, _E, _D), out_bias),
        }

    def mlp(self, x, lw):
        c = self.config
        weights, scales = expert_stacks(lw, _EXPERTS, x.dtype)
        return moe_block(x, lw["router"], weights, scales, top_k=c.num_experts_per_tok,
                         normalize=True, mesh=self.mesh, expert_parallel=c.expert_parallel,
                         router_bias=lw["router_bias"], biases=tuple(lw[n + "_bias"] for n in _EXPERTS),
                         swiglu=c.swiglu)
