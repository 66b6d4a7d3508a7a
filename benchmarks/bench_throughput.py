"""Offline throughput, like `vllm bench throughput` (BM-12): one LLM.generate over all
prompts, ignore_eos, fixed output length.

    python benchmarks/bench_throughput.py --num-prompts 64 --input-len 128 --output-len 64 --temperature 0

Against peers on the same prompts (random token ids, lengths drawn with the seed), each
peer run first, one after the other, in its own Python environment
(benchmarks/peer_throughput.py), then jaxserve; one table of all of them at the end:

    python benchmarks/bench_throughput.py --input-len-range 32 256 --peer vllm hf \
        --peer-python vllm=../vllm-venv/bin/python   # hf: this Python (torch from the test extra)
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

from common import (commit_line, cpu_line, engine_kwargs, machine_line, parse_engine_args, plot_bars,  # noqa: E402
                    run_peer_script)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="prompt lengths drawn uniformly from [MIN, MAX] (instead of --input-len)")
    ap.add_argument("--peer", choices=("vllm", "hf", "llamacpp"), nargs="+", default=[],
                    help="also run these prompts through these engines (benchmarks/peer_throughput.py), first, "
                         "and print the ratios")
    ap.add_argument("--peer-python", nargs="+", default=[],
                    help="the Python of the peers' environment: one path for all, or ENGINE=PATH each "
                         "(default: this Python)")
    ap.add_argument("--peer-dtype", nargs="+", default=["auto"],
                    help="the peers' dtypes (vLLM, HF), one run of each peer per value: auto (default: each "
                         "engine's own default, which for vLLM on an x86 CPU is bfloat16 even for a float32 "
                         "checkpoint; the comparison a user makes), float32 (like for like) or bfloat16")
    ap.add_argument("--also-dtype", nargs="+", default=[],
                    help="after jaxserve at --dtype, run it again at each of these dtypes (a row each)")
    ap.add_argument("--also-batch-invariant", action="store_true",
                    help="a second jaxserve row with --batch-invariant (its cost: docs/batch_invariance.md)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="also draw the table's output tok/s as a bar chart (matplotlib)")
    ap.add_argument("--peer-model", default=None,
                    help="the peer's model (default: the same HF folder; llamacpp: the default model's GGUF file)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--no-compilation-cache", action="store_true", help="measure a cold warm-up")
    # The engine's flags (EngineArgs); --seed also draws the prompts, --max-model-len bounds them.
    args, engine_args = parse_engine_args(ap, max_model_len=1024)

    from models.default_model import default_model_dir

    model_dir = Path(engine_args.model) if engine_args.model else default_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    token_prompts = make_prompts(args, vocab)
    # First, so that the peers' start-up and runs share nothing with ours.
    peers = [run_peer(args, name, model_dir, token_prompts, dtype) for name in args.peer
             for dtype in (args.peer_dtype if name != "llamacpp" else ["auto"])]
    rows = [run_jaxserve(args, engine_args, model_dir, token_prompts, dtype)
            for dtype in [engine_args.dtype, *args.also_dtype]]
    if args.also_batch_invariant and not engine_args.batch_invariant:
        rows.append(run_jaxserve(args, engine_args, model_dir, token_prompts, engine_args.dtype, batch_invariant=True))
    ours = rows[0]["output_tokens_per_s"]
    if peers or len(rows) > 1:
        print("\n| engine | output tok/s | tokens in s | start-up (s) | first row / engine |")
        print("|---|---|---|---|---|")
        for row in rows + peers:
            ratio = "" if row is rows[0] else f"{ours / row['output_tokens_per_s']:.2f}x"
            print(f"| {row['label']} | {row['output_tokens_per_s']:.2f} | {row['output_tokens']} in "
                  f"{row['elapsed_s']:.1f} | {row['startup_s']:.1f} | {ratio} |")
    if args.plot:
        plot_bars(args.plot, [r["label"] for r in rows + peers], [r["output_tokens_per_s"] for r in rows + peers],
                  ylabel="output tokens/s",
                  title=f"{len(token_prompts)} prompts of {min(map(len, token_prompts))}-"
                        f"{max(map(len, token_prompts))} tokens, {args.output_len} out; {cpu_line()}")
        print(f"chart: {args.plot}")
    if args.output_json:
        r = rows[0]
        total = r["prompt_tokens"] + r["output_tokens"]
        Path(args.output_json).write_text(json.dumps({
            "elapsed_time": r["elapsed_s"], "num_requests": len(token_prompts), "total_num_tokens": total,
            "requests_per_second": len(token_prompts) / r["elapsed_s"], "tokens_per_second": total / r["elapsed_s"],
        }, indent=2))


def run_jaxserve(args, engine_args, model_dir: Path, token_prompts: list[list[int]], dtype: str,
                 batch_invariant: bool | None = None) -> dict:
    """One LLM.generate over the prompts with the engine at ``dtype`` (and
    ``batch_invariant``, default: the flag's); prints its report."""
    from jaxserve import LLM, SamplingParams

    if batch_invariant is None:
        batch_invariant = engine_args.batch_invariant
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(engine_args, model=str(model_dir), dtype=dtype, batch_invariant=batch_invariant),
              compilation_cache=not args.no_compilation_cache)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    sp = SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(machine_line())
    print(commit_line())
    runner = llm.llm_engine.model_runner
    kinds = (f"activations {np.dtype(runner.dtype).name}, matmul weights {np.dtype(runner.param_dtype).name}, "
             f"KV {np.dtype(runner.kv_dtype).name}")
    print(f"dtype {dtype} ({kinds}), peers' dtypes {' '.join(args.peer_dtype)}, "
          f"quantization {args.quantization}, attention {runner.attention_backend}, "
          f"scan_layers {args.scan_layers}, async scheduling {args.async_scheduling}, batch-invariant "
          f"{batch_invariant}, prompts {len(token_prompts)} of "
          f"{min(map(len, token_prompts))}-{max(map(len, token_prompts))} tokens, output {args.output_len}")
    print(f"startup (load + warm-up): {startup:.1f} s; warm-up {llm.llm_engine.warmup_seconds:.1f} s, "
          f"{llm.llm_engine.num_compiled_programs} programs")
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    label = f"jaxserve --dtype {dtype}{' --batch-invariant' if batch_invariant else ''} ({kinds})"
    return {"label": label, "output_tokens_per_s": output_tokens / elapsed,
            "output_tokens": output_tokens, "prompt_tokens": prompt_tokens, "elapsed_s": elapsed,
            "startup_s": startup}


def make_prompts(args, vocab: int) -> list[list[int]]:
    """Random token prompts (BM "random" dataset), ids above the special tokens at the bottom;
    lengths --input-len, or drawn from --input-len-range, with --seed."""
    rng = np.random.default_rng(args.seed)
    lo, hi = args.input_len_range or (args.input_len, args.input_len)
    if hi + args.output_len > args.max_model_len:
        raise SystemExit("max_model_len must be >= the longest prompt + output_len")
    lens = rng.integers(lo, hi + 1, args.num_prompts)
    return [rng.integers(100, vocab, n).tolist() for n in lens]


def peer_python(args, name: str) -> str:
    """--peer-python: ENGINE=PATH for this engine, else a plain PATH, else this Python."""
    plain = [p for p in args.peer_python if "=" not in p]
    named = dict(p.split("=", 1) for p in args.peer_python if "=" in p)
    return named.get(name) or (plain[0] if plain else sys.executable)


def run_peer(args, name: str, model_dir: Path, prompts: list[list[int]], dtype: str) -> dict:
    """The peer ``name`` at ``dtype`` on the same prompts, in its own process and environment."""
    from models.default_model import default_gguf_path

    model = args.peer_model or (str(default_gguf_path()) if name == "llamacpp" else str(model_dir))
    row = run_peer_script(peer_python(args, name), prompts, name, model, "--output-len", str(args.output_len),
                          "--batch-size", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                          "--dtype", dtype)
    return row | {"label": f"{name} {row['version']}" + ("" if name == "llamacpp" else f" --dtype {dtype}")}


if __name__ == "__main__":
    main()
