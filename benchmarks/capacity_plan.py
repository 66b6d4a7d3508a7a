"""On paper: what a model gets on a TPU slice, from the code's own formulas.

For each (data, model) mesh that fits the chip count, prints per-chip weight bytes
(models' weight_map at the effective tensor-parallel arch: padded vocabulary,
replicated KV heads), the KV budget the runner would measure (HBM x
gpu_memory_utilization - bytes in use, as runner/kv_cache.py's determine_num_blocks),
the KV tokens per rank and in all, and a decode-step roofline at a given batch and
context: HBM time (weights + KV read once per step), tensor-parallel all-reduce time
(2 per layer over ICI, ring), and the prefill compute time for one chunk.

    python benchmarks/capacity_plan.py                       # Llama-3-70B on v5e-32 and v5p-64
    python benchmarks/capacity_plan.py --model gpt-oss-120b  # v5e-16, v5p-16, v6e-8, an 8x H200 node
    python benchmarks/capacity_plan.py --model deepseek-v3   # v5e-256, v5p-64, v6e-64, an 8x H200 node
    python benchmarks/capacity_plan.py --config config.json --chip v5e --chips 32

Sliding-window layers are counted with whole-context KV (an upper bound: GPT-OSS's
window layers hold 128 tokens each), MoE decode reads the experts its batch routes to
(``experts_read``), prefill FLOPs count each token's top-k experts. An MLA model's
latent KV rows are whole on every chip of a rank (the "KV heads" column says "latent").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax.numpy as jnp  # noqa: E402

from jaxserve.runner.kv_cache import bytes_per_block, determine_num_blocks, devices_per_block  # noqa: E402
from models.base import MODEL  # noqa: E402
from models.config import ModelArchConfig  # noqa: E402
from models.registry import get_model_class  # noqa: E402
from models.quantization import quantized_names  # noqa: E402
from models.sharding import arch_for_tensor_parallel, valid_tensor_parallel_sizes  # noqa: E402

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
}
# gpt-oss-120b's config.json (bf16 experts: its MXFP4 ones are served on CPU only).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "attention_bias": True,
}
# DeepSeek-V3's config.json (671B; its fp8 block-scaled checkpoint: --weights fp8-block). MLA: one latent of 512 + a rope key of 64 per token per layer.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096},
}
MODELS = {"llama-3-70b": LLAMA3_70B, "gpt-oss-120b": GPT_OSS_120B, "deepseek-v3": DEEPSEEK_V3}
# The slices each model is planned on when --chip is not given.
TARGETS = {
    "llama-3-70b": [("v5e", 32), ("v5p", 32)],  # v5p-64 = 32 chips
    "gpt-oss-120b": [("v5e", 16), ("v5p", 8), ("v6e", 8), ("h200", 8)],
    "deepseek-v3": [("v5e", 256), ("v5p", 32), ("v6e", 64), ("h200", 8)],
}
# Per chip: HBM GiB, HBM GB/s, bf16 TFLOP/s (dense), ICI GB/s (all links together; the
# H200's NVLink), all-reduce latency s. An "8x H200 node" is --chip h200 --chips 8.
CHIPS = {
    "v5e": dict(hbm_gib=16, hbm_gbs=819, tflops=197, ici_gbs=200, ar_latency=15e-6),
    "v5p": dict(hbm_gib=95, hbm_gbs=2765, tflops=459, ici_gbs=600, ar_latency=10e-6),
    "v6e": dict(hbm_gib=32, hbm_gbs=1640, tflops=918, ici_gbs=400, ar_latency=10e-6),
    "h200": dict(hbm_gib=141, hbm_gbs=4800, tflops=989, ici_gbs=900, ar_latency=8e-6),
}


class _Device:  # what determine_num_blocks reads from a jax.Device
    def __init__(self, limit, in_use):
        self._stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


# Bytes per weight of a projection kept as its packed checkpoint stores it
# (models/quantization.py GROUP_SCALED): the codes plus float32 group scales (int4: and
# zeros) per 128 (fp8 blocks, int4 groups) or 32 (MXFP4) input rows.
PACKED_BYTES = {"fp8-block": 1 + 4 / 128, "int4": 0.5 + 8 / 128, "mxfp4": 0.5 + 4 / 32}


def packed_names(arch: ModelArchConfig, weights: str) -> set[str]:
    """The params a checkpoint in ``weights`` keeps packed: MXFP4 only the MoE experts (as
    OpenAI ships gpt-oss), fp8 / int4 every projection int8 would take; none for bf16."""
    if weights == "bf16":
        return set()
    names = set(quantized_names(get_model_class(arch.architecture).weight_map(arch)))
    return {n for n in names if n.startswith("experts_")} if weights == "mxfp4" else names


def weight_bytes_per_chip(arch: ModelArchConfig, tp: int, itemsize: int, experts_share: float = 1.0,
                          weights: str = "bf16") -> int:
    """Bytes of one chip's weights, ``weights`` the checkpoint's packed format (or bf16);
    ``experts_share`` counts only that share of the MoE experts' (the ones a step reads,
    or a token's top-k for FLOPs)."""
    total = 0
    packed = packed_names(arch, weights)
    for name, w in get_model_class(arch.architecture).weight_map(arch).items():
        n = math.prod(w.shape(arch)) * (PACKED_BYTES[weights] if name in packed else itemsize)
        n = n * experts_share if name.startswith("experts_") else n
        total += n // tp if MODEL in w.partition else n
    return int(total)


def experts_read(arch: ModelArchConfig, tokens: int) -> float:
    """The expected share of a MoE layer's experts that ``tokens`` routed tokens touch
    (each picks top-k of E, taken as uniform): 1 - (1 - k / E)^tokens; 1 for a dense model."""
    if not arch.num_experts:
        return 1.0
    return 1.0 - (1.0 - arch.num_experts_per_tok / arch.num_experts) ** max(tokens, 1)


def plan(cfg: dict, chip: str, chips: int, *, batch: int, context: int, prefill: int, util: float,
         block_size: int = 16, dtype=jnp.bfloat16, weights: str = "bf16") -> None:
    spec = CHIPS[chip]
    base = ModelArchConfig.from_hf_dict(cfg)
    itemsize = jnp.dtype(dtype).itemsize
    print(f"\n{base.architecture} ({sum(math.prod(w.shape(base)) for w in get_model_class(base.architecture).weight_map(base).values()) / 1e9:.1f}B params, {weights} weights) "
          f"on {chip} x {chips} chips ({spec['hbm_gib']} GiB HBM each), decode batch {batch} per rank at "
          f"{context} tokens of context (fewer where the KV cache holds fewer), gpu_memory_utilization {util}")
    print(f"{'mesh (dp x tp)':>14} {'KV heads':>9} {'weights/chip':>13} {'KV budget/chip':>15} {'KV tokens/rank':>15} "
          f"{'KV tokens all':>14} {'batch':>6} {'decode: HBM':>12} {'all-reduce':>11} {'prefill ' + str(prefill):>13}")
    for tp in valid_tensor_parallel_sizes(base):
        if chips % tp:
            continue
        dp = chips // tp
        arch = arch_for_tensor_parallel(base, tp)
        heads = "latent" if arch.latent_kv else arch.num_key_value_heads
        wb = weight_bytes_per_chip(arch, tp, itemsize, weights=weights)
        limit = int(spec["hbm_gib"] * 2**30)
        budget = int(limit * util) - wb
        if budget <= 0:
            print(f"{dp:>6} x {tp:<5} {heads:>9} {wb / 2**30:>10.1f} GiB  does not fit")
            continue
        blocks = determine_num_blocks(arch, block_size=block_size, dtype=dtype, max_model_len=min(context, 8192),
                                      gpu_memory_utilization=util, kv_cache_memory=None, num_gpu_blocks_override=None,
                                      device=_Device(limit, wb), tensor_parallel_size=tp, num_devices=chips)
        tokens = (blocks - 1) * block_size
        kv_per_token_chip = bytes_per_block(arch, block_size, dtype) / block_size / devices_per_block(arch, tp)
        b = min(batch, tokens // context)  # the decode batch the cache holds at this context
        # A decode step reads the experts its b tokens route to; prefill multiplies each
        # token by its top-k experts only.
        read = weight_bytes_per_chip(arch, tp, itemsize, experts_read(arch, b), weights)
        hbm_s = (read + b * context * kv_per_token_chip) / (spec["hbm_gbs"] * 1e9)
        ar_bytes = b * arch.hidden_size * itemsize
        ar_s = 0.0 if tp == 1 else 2 * arch.num_hidden_layers * (
            spec["ar_latency"] + 2 * (tp - 1) / tp * ar_bytes / (spec["ici_gbs"] * 1e9))
        active = weight_bytes_per_chip(arch, tp, itemsize, arch.num_experts_per_tok / arch.num_experts
                                       if arch.num_experts else 1.0)  # bf16 bytes: the FLOPs count
        flops = 2 * (active * tp / itemsize) * prefill  # ~2 FLOPs per active weight per token
        prefill_s = flops / (tp * spec["tflops"] * 1e12)
        print(f"{dp:>6} x {tp:<5} {heads:>9} {wb / 2**30:>10.1f} GiB {budget / 2**30:>11.1f} GiB "
              f"{tokens:>15,} {tokens * dp:>14,} {b:>6} {1000 * hbm_s:>9.1f} ms {1000 * ar_s:>8.1f} ms "
              f"{1000 * prefill_s:>10.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="an HF config.json (default: --model's)")
    ap.add_argument("--model", choices=list(MODELS), default="llama-3-70b")
    ap.add_argument("--chip", choices=list(CHIPS))
    ap.add_argument("--chips", type=int)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--weights", choices=("bf16", *PACKED_BYTES), default="bf16",
                    help="the checkpoint's weights: bf16, or a packed format served as stored (DeepSeek-V3's "
                         "fp8-block, gpt-oss's mxfp4 experts, int4 AWQ / GPTQ)")
    args = ap.parse_args()
    import logging

    logging.getLogger("jaxserve").setLevel(logging.WARNING)
    cfg = json.load(open(args.config)) if args.config else MODELS[args.model]
    targets = [(args.chip, args.chips)] if args.chip else TARGETS[args.model]
    for chip, n in targets:
        plan(cfg, chip, n, batch=args.batch, context=args.context, prefill=args.prefill,
             util=args.gpu_memory_utilization, weights=args.weights)


if __name__ == "__main__":
    main()
