"""Weight-only int8 against the unquantized model: greedy agreement and logprob error on
64 chat prompts, and offline throughput, for each of f32, bf16 and int8 weights.

    python benchmarks/bench_quantization.py                # the default model
    python benchmarks/bench_quantization.py --variants float32:none float32:int8
    python benchmarks/bench_quantization.py --variants float32:none float32:awq float32:gptq float32:w4a16
    python benchmarks/bench_quantization.py --variants float32:none float32:none:bfloat16 auto:none \
        auto:none:auto:bfloat16

Agreement is against the first variant (the reference): the share of the 64 greedy
outputs that are identical, the mean length of the common prefix, and the mean |logprob
difference| of the reference's chosen tokens over that common prefix (where both models
saw the same context). Throughput: ``--num-prompts`` random-token prompts of
``--input-len`` tokens, ``--output-len`` greedy tokens each, ignore_eos.

The packed quantizations (awq, gptq, w4a16, fp8-block) are checkpoint formats, not
load-time options: the model's projections are written in that format
(models/packed_formats.py's reference packers: round to nearest in groups (fp8: square
blocks) of ``--group-size``, no calibration) into a temporary folder, which the engine
then serves: decoded to floats at load (``awq``: the CPU's default), or with ``-kept``
(``awq-kept``, ``fp8-block-kept``; ``-int4`` for the int4 ones too) kept as stored and
dequantized inside each product (``--quantization awq`` / ``fp8``, TPU / GPU's default).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (commit_line, cpu_line, engine_kwargs, machine_line, parse_engine_args,  # noqa: E402
                    run_peer_script)

SUBJECTS = ["the ocean", "a volcano", "photosynthesis", "the moon", "bread", "a bicycle", "rain", "music",
            "the internet", "chess", "honey bees", "a library", "gravity", "coffee", "winter", "a computer"]
ASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "Give three facts about {}.",
        "Why is {} important?"]


PACKED_FORMATS = ("awq", "gptq", "w4a16", "fp8-block")


def chat_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": ask.format(s)}] for s in SUBJECTS for ask in ASKS]  # 64


def agreement(ref, other) -> tuple[int, float, float]:
    """(identical outputs, mean common prefix, mean |logprob diff| of the reference's
    tokens over the common prefix); each output is (token ids, their logprobs)."""
    same, prefix, lp_err = 0, [], []
    for (a_ids, a_lps), (b_ids, b_lps) in zip(ref, other):
        a_ids, b_ids = list(a_ids), list(b_ids)
        n = 0
        while n < min(len(a_ids), len(b_ids)) and a_ids[n] == b_ids[n]:
            n += 1
        same += a_ids == b_ids
        prefix.append(n)
        lp_err += [abs(a_lps[i] - b_lps[i]) for i in range(n)]
    return same, float(np.mean(prefix)), float(np.mean(lp_err)) if lp_err else 0.0


def run_peer_greedy(args, prompts: list[list[int]], dtype: str) -> dict:
    """vLLM's greedy outputs (EOS respected, --max-tokens) on these prompt tokens, in its
    own Python (peer_throughput.py --greedy)."""
    from models.default_model import default_model_dir

    return run_peer_script(args.peer_python, prompts, args.peer, args.model or str(default_model_dir()),
                           "--output-len", str(args.max_tokens), "--dtype", dtype, "--greedy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["float32:none", "bfloat16:none", "float32:int8"],
                    help="dtype:quantization[:weight_dtype[:kv_cache_dtype]] (default auto); the first is the reference")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64, help="input rows per int4 scale (the int4 variants)")
    ap.add_argument("--peer", choices=("vllm",), default=None,
                    help="also measure vLLM's agreement with the reference (the first variant), on the same "
                         "prompt tokens, once per --peer-dtypes")
    ap.add_argument("--peer-python", default=sys.executable, help="the Python of the peer's environment")
    ap.add_argument("--peer-dtypes", nargs="+", default=["auto", "float32"],
                    help="the peer's dtypes (auto: its own default, bfloat16 for vLLM on an x86 CPU)")
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
        overrides = {}
        fmt = quant
        for suffix in ("-int4", "-kept"):
            fmt = fmt[:-len(suffix)] if fmt and fmt.endswith(suffix) else fmt
        if fmt in PACKED_FORMATS:  # a checkpoint format: write the model in it, serve that folder
            from models.default_model import default_model_dir
            from models.packed_formats import quantization_name, write_int4_folder

            folder = Path(tempfile.mkdtemp(prefix=f"jaxserve-{fmt}-"))
            write_int4_folder(engine_args.model or default_model_dir(), folder, fmt, args.group_size)
            # "<fmt>-kept" ("-int4"): the weights kept as stored (TPU / GPU's way); "<fmt>": decoded at load.
            keep = quantization_name(fmt) if fmt != quant else None
            overrides, quant = dict(model=str(folder)), keep
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(engine_args, dtype=dtype, quantization=quant, weight_dtype=weight_dtype,
                                  kv_cache_dtype=kv_dtype, **overrides))
        runner = llm.llm_engine.engine_core.model_runner
        variant += (f" (weights {np.dtype(runner.param_dtype).name}, activations {np.dtype(runner.dtype).name}, "
                    f"KV {np.dtype(runner.kv_dtype).name})")
        startup = time.perf_counter() - t0
        results = llm.chat(chat_prompts(), greedy, use_tqdm=False)
        outs = [o.outputs[0] for o in results]
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(100, llm.llm_engine.vocab_size, args.input_len).tolist()}
                   for _ in range(args.num_prompts)]
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
        t0 = time.perf_counter()
        done = llm.generate(prompts, sp, use_tqdm=False)
        tput = sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - t0)
        mine = [(o.token_ids, [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]) for o in outs]
        if ref is None:
            ref_prompts = [list(o.prompt_token_ids) for o in results]  # the peer gets the same tokens
            ref = mine
        rows.append((variant, startup, tput, *agreement(ref, mine)))
        print(f"{variant}: startup {startup:.1f} s, {tput:.1f} output tok/s, identical {rows[-1][3]}/{len(outs)}, "
              f"common prefix {rows[-1][4]:.1f}/{args.max_tokens}, mean |dlogprob| {rows[-1][-1]:.4f}",
              flush=True)
        del llm
    for dtype in (args.peer_dtypes if args.peer else []):
        peer = run_peer_greedy(args, ref_prompts, dtype)
        mine = [(o["ids"], o["logprobs"]) for o in peer["outputs"]]
        rows.append((f"vLLM {peer['version']} --dtype {dtype} ({peer['dtype']})", 0.0, float("nan"),
                     *agreement(ref, mine)))
        print(f"{rows[-1][0]}: identical {rows[-1][3]}/{len(mine)}, common prefix {rows[-1][4]:.1f}, "
              f"mean |dlogprob| {rows[-1][-1]:.4f}", flush=True)
    print("\n| weights | output tok/s | greedy outputs identical to the first | mean common prefix | "
          "mean abs logprob diff |")
    print("|---|---|---|---|---|")
    for variant, _, tput, same, prefix, err in rows:
        print(f"| {variant} | {tput:.1f} | {same}/{len(ref)} | {prefix:.1f} / {args.max_tokens} | {err:.4f} |")


if __name__ == "__main__":
    main()
