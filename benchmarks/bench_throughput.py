"""Offline throughput, like `vllm bench throughput` (BM-12): one LLM.generate over all
prompts, ignore_eos, fixed output length.

    python benchmarks/bench_throughput.py --num-prompts 64 --input-len 128 --output-len 64 --temperature 0
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, machine_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="int8: weight-only int8 projections")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--no-compilation-cache", action="store_true", help="measure a cold warm-up")
    args = ap.parse_args()

    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, dtype=args.dtype,
              quantization=args.quantization, compilation_cache=not args.no_compilation_cache)
    startup = time.perf_counter() - t0
    vocab = llm.llm_engine.vocab_size
    rng = np.random.default_rng(args.seed)
    # Random token prompts (BM "random" dataset); ids avoid the special tokens at the bottom.
    prompts = [{"prompt_token_ids": rng.integers(100, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit("max_model_len must be >= input_len + output_len")
    sp = SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(machine_line())
    print(commit_line())
    print(f"dtype {args.dtype}, quantization {args.quantization}")
    print(f"startup (load + warm-up): {startup:.1f} s; warm-up {llm.llm_engine.warmup_seconds:.1f} s, "
          f"{llm.llm_engine.num_compiled_programs} programs")
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "elapsed_time": elapsed, "num_requests": len(outs), "total_num_tokens": total,
            "requests_per_second": len(outs) / elapsed, "tokens_per_second": total / elapsed,
        }, indent=2))


if __name__ == "__main__":
    main()
