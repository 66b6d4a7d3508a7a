"""Weight-only int8 against the unquantized model: greedy agreement and logprob error on
64 chat prompts, and offline throughput, for each of f32, bf16 and int8 weights.

    python benchmarks/bench_quantization.py                # the default model
    python benchmarks/bench_quantization.py --variants float32:none float32:int8
    python benchmarks/bench_quantization.py --variants float32:none float32:none:bfloat16 auto:none \
        auto:none:auto:bfloat16

Agreement is against the first variant (the reference): the share of the 64 greedy
outputs that are identical, the mean length of the common prefix, and the mean |logprob
difference| of the reference's chosen tokens over that common prefix (where both models
saw the same context). Throughput: ``--num-prompts`` random-token prompts of
``--input-len`` tokens, ``--output-len`` greedy tokens each, ignore_eos.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, cpu_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402

SUBJECTS = ["the ocean", "a volcano", "photosynthesis", "the moon", "bread", "a bicycle", "rain", "music",
            "the internet", "chess", "honey bees", "a library", "gravity", "coffee", "winter", "a computer"]
ASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "Give three facts about {}.",
        "Why is {} important?"]


def chat_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": ask.format(s)}] for s in SUBJECTS for ask in ASKS]  # 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["float32:none", "bfloat16:none", "float32:int8"],
                    help="dtype:quantization[:weight_dtype[:kv_cache_dtype]] (default auto); the first is the reference")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    # The engine's flags; each variant sets the dtypes and the quantization.
    args, engine_args = parse_engine_args(ap, fixed=("dtype", "quantization", "weight_dtype", "kv_cache_dtype"),
                                          max_model_len=512)
    from jaxserve import LLM, SamplingParams

    print(machine_line())
    print(cpu_line())
    print(commit_line())
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0)
    ref = None
    rows = []
    for variant in args.variants:
        dtype, quant, *rest = variant.split(":")
        weight_dtype, kv_dtype = (rest + ["auto", "auto"])[:2]
        quant = None if quant == "none" else quant
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(engine_args, dtype=dtype, quantization=quant, weight_dtype=weight_dtype,
                                  kv_cache_dtype=kv_dtype))
        runner = llm.llm_engine.engine_core.model_runner
        variant += (f" (weights {np.dtype(runner.param_dtype).name}, activations {np.dtype(runner.dtype).name}, "
                    f"KV {np.dtype(runner.kv_dtype).name})")
        startup = time.perf_counter() - t0
        outs = [o.outputs[0] for o in llm.chat(chat_prompts(), greedy, use_tqdm=False)]
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(100, llm.llm_engine.vocab_size, args.input_len).tolist()}
                   for _ in range(args.num_prompts)]
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
        t0 = time.perf_counter()
        done = llm.generate(prompts, sp, use_tqdm=False)
        tput = sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - t0)
        if ref is None:
            ref = outs
        same, prefix, lp_err = 0, [], []
        for a, b in zip(ref, outs):
            n = 0
            while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
                n += 1
            same += a.token_ids == b.token_ids
            prefix.append(n)
            lp_err += [abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob)
                       for i in range(n)]
        rows.append((variant, startup, tput, same, float(np.mean(prefix)), float(np.mean(lp_err)) if lp_err else 0.0))
        print(f"{variant}: startup {startup:.1f} s, {tput:.1f} output tok/s, identical {same}/{len(outs)}, "
              f"common prefix {np.mean(prefix):.1f}/{args.max_tokens}, mean |dlogprob| {rows[-1][-1]:.4f}",
              flush=True)
        del llm
    print("\n| weights | output tok/s | greedy outputs identical to the first | mean common prefix | "
          "mean abs logprob diff |")
    print("|---|---|---|---|---|")
    for variant, _, tput, same, prefix, err in rows:
        print(f"| {variant} | {tput:.1f} | {same}/{len(ref)} | {prefix:.1f} / {args.max_tokens} | {err:.4f} |")


if __name__ == "__main__":
    main()
