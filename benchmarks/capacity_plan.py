"""On paper: what a model gets on a TPU slice, from the code's own formulas.

For each (data, model) mesh that fits the chip count, prints per-chip weight bytes
(models' weight_map at the effective tensor-parallel arch: padded vocabulary,
replicated KV heads), the KV budget the runner would measure (HBM x
gpu_memory_utilization - bytes in use, as runner/kv_cache.py's determine_num_blocks),
the KV tokens per rank and in all, and a decode-step roofline at a given batch and
context: HBM time (weights + KV read once per step), tensor-parallel all-reduce time
(2 per layer over ICI, ring), and the prefill compute time for one chunk.

    python benchmarks/capacity_plan.py                       # Llama-3-70B on v5e-32 and v5p-64
    python benchmarks/capacity_plan.py --config config.json --chip v5e --chips 32
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax.numpy as jnp  # noqa: E402

from jaxserve.runner.kv_cache import bytes_per_block, determine_num_blocks  # noqa: E402
from models.base import MODEL  # noqa: E402
from models.config import ModelArchConfig  # noqa: E402
from models.registry import get_model_class  # noqa: E402
from models.sharding import arch_for_tensor_parallel, valid_tensor_parallel_sizes  # noqa: E402

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
}
# Per chip: HBM GiB, HBM GB/s, bf16 TFLOP/s, ICI GB/s (all links together), all-reduce latency s.
CHIPS = {
    "v5e": dict(hbm_gib=16, hbm_gbs=819, tflops=197, ici_gbs=200, ar_latency=15e-6),
    "v5p": dict(hbm_gib=95, hbm_gbs=2765, tflops=459, ici_gbs=600, ar_latency=10e-6),
}


class _Device:  # what determine_num_blocks reads from a jax.Device
    def __init__(self, limit, in_use):
        self._stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


def weight_bytes_per_chip(arch: ModelArchConfig, tp: int, itemsize: int) -> int:
    total = 0
    for w in get_model_class(arch.architecture).weight_map(arch).values():
        n = math.prod(w.shape(arch)) * itemsize
        total += n // tp if MODEL in w.partition else n
    return total


def plan(cfg: dict, chip: str, chips: int, *, batch: int, context: int, prefill: int, util: float,
         block_size: int = 16, dtype=jnp.bfloat16) -> None:
    spec = CHIPS[chip]
    base = ModelArchConfig.from_hf_dict(cfg)
    itemsize = jnp.dtype(dtype).itemsize
    print(f"\n{base.architecture} ({sum(math.prod(w.shape(base)) for w in get_model_class(base.architecture).weight_map(base).values()) / 1e9:.1f}B params, bf16) "
          f"on {chip} x {chips} chips ({spec['hbm_gib']} GiB HBM each), decode batch {batch} per rank at "
          f"{context} tokens of context (fewer where the KV cache holds fewer), gpu_memory_utilization {util}")
    print(f"{'mesh (dp x tp)':>14} {'KV heads':>9} {'weights/chip':>13} {'KV budget/chip':>15} {'KV tokens/rank':>15} "
          f"{'KV tokens all':>14} {'batch':>6} {'decode: HBM':>12} {'all-reduce':>11} {'prefill ' + str(prefill):>13}")
    for tp in valid_tensor_parallel_sizes(base):
        if chips % tp:
            continue
        dp = chips // tp
        arch = arch_for_tensor_parallel(base, tp)
        wb = weight_bytes_per_chip(arch, tp, itemsize)
        limit = int(spec["hbm_gib"] * 2**30)
        budget = int(limit * util) - wb
        if budget <= 0:
            print(f"{dp:>6} x {tp:<5} {arch.num_key_value_heads:>9} {wb / 2**30:>10.1f} GiB  does not fit")
            continue
        blocks = determine_num_blocks(arch, block_size=block_size, dtype=dtype, max_model_len=min(context, 8192),
                                      gpu_memory_utilization=util, kv_cache_memory=None, num_gpu_blocks_override=None,
                                      device=_Device(limit, wb), tensor_parallel_size=tp, num_devices=chips)
        tokens = (blocks - 1) * block_size
        kv_per_token_chip = bytes_per_block(arch, block_size, dtype) / block_size / tp
        b = min(batch, tokens // context)  # the decode batch the cache holds at this context
        hbm_s = (wb + b * context * kv_per_token_chip) / (spec["hbm_gbs"] * 1e9)
        ar_bytes = b * arch.hidden_size * itemsize
        ar_s = 0.0 if tp == 1 else 2 * arch.num_hidden_layers * (
            spec["ar_latency"] + 2 * (tp - 1) / tp * ar_bytes / (spec["ici_gbs"] * 1e9))
        flops = 2 * (wb * tp / itemsize) * prefill  # ~2 FLOPs per weight per token, whole model
        prefill_s = flops / (tp * spec["tflops"] * 1e12)
        print(f"{dp:>6} x {tp:<5} {arch.num_key_value_heads:>9} {wb / 2**30:>10.1f} GiB {budget / 2**30:>11.1f} GiB "
              f"{tokens:>15,} {tokens * dp:>14,} {b:>6} {1000 * hbm_s:>9.1f} ms {1000 * ar_s:>8.1f} ms "
              f"{1000 * prefill_s:>10.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="an HF config.json (default: Llama-3-70B's)")
    ap.add_argument("--chip", choices=list(CHIPS))
    ap.add_argument("--chips", type=int)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    import logging

    logging.getLogger("jaxserve").setLevel(logging.WARNING)
    cfg = json.load(open(args.config)) if args.config else LLAMA3_70B
    targets = [(args.chip, args.chips)] if args.chip else [("v5e", 32), ("v5p", 32)]  # v5p-64 = 32 chips
    for chip, n in targets:
        plan(cfg, chip, n, batch=args.batch, context=args.context, prefill=args.prefill,
             util=args.gpu_memory_utilization)


if __name__ == "__main__":
    main()
