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

from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402


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
    ap.add_argument("--peer-dtype", default="float32",
                    help="the peers' dtype (vLLM, HF): float32 (default) or bfloat16")
    ap.add_argument("--peer-model", default=None,
                    help="the peer's model (default: the same HF folder; llamacpp: the default model's GGUF file)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--no-compilation-cache", action="store_true", help="measure a cold warm-up")
    # The engine's flags (EngineArgs); --seed also draws the prompts, --max-model-len bounds them.
    args, engine_args = parse_engine_args(ap, max_model_len=1024)

    from jaxserve import LLM, SamplingParams

    from models.default_model import default_model_dir

    model_dir = Path(engine_args.model) if engine_args.model else default_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    token_prompts = make_prompts(args, vocab)
    # First, so that the peers' start-up and runs share nothing with ours.
    peers = [run_peer(args, name, model_dir, token_prompts) for name in args.peer]
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(engine_args, model=str(model_dir)), compilation_cache=not args.no_compilation_cache)
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
    print(f"dtype {args.dtype} (activations {np.dtype(runner.dtype).name}, matmul weights "
          f"{np.dtype(runner.param_dtype).name}), peers' dtype {args.peer_dtype}, "
          f"quantization {args.quantization}, kv cache {args.kv_cache_dtype}, "
          f"attention {runner.attention_backend}, "
          f"scan_layers {args.scan_layers}, async scheduling {args.async_scheduling}, prompts {len(token_prompts)} of "
          f"{min(map(len, token_prompts))}-{max(map(len, token_prompts))} tokens, output {args.output_len}")
    print(f"startup (load + warm-up): {startup:.1f} s; warm-up {llm.llm_engine.warmup_seconds:.1f} s, "
          f"{llm.llm_engine.num_compiled_programs} programs")
    print(f"Throughput: {len(outs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if peers:
        ours = output_tokens / elapsed
        print("\n| engine | output tok/s | tokens in s | start-up (s) | jaxserve / engine |")
        print("|---|---|---|---|---|")
        print(f"| jaxserve | {ours:.2f} | {output_tokens} in {elapsed:.1f} | {startup:.1f} | |")
        for peer in peers:
            print(f"| {peer['engine']} {peer['version']} | {peer['output_tokens_per_s']:.2f} | "
                  f"{peer['output_tokens']} in {peer['elapsed_s']:.1f} | {peer['startup_s']:.1f} | "
                  f"{ours / peer['output_tokens_per_s']:.2f}x |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "elapsed_time": elapsed, "num_requests": len(outs), "total_num_tokens": total,
            "requests_per_second": len(outs) / elapsed, "tokens_per_second": total / elapsed,
        }, indent=2))


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


def run_peer(args, name: str, model_dir: Path, prompts: list[list[int]]) -> dict:
    """The peer ``name`` on the same prompts, in its own process and environment."""
    import subprocess
    import tempfile

    from models.default_model import default_gguf_path

    model = args.peer_model or (str(default_gguf_path()) if name == "llamacpp" else str(model_dir))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [peer_python(args, name), str(Path(__file__).with_name("peer_throughput.py")), "--engine", name,
           "--model", model, "--prompts", f.name, "--output-len", str(args.output_len),
           "--batch-size", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--dtype", args.peer_dtype]
    print(f"Running the peer: {' '.join(cmd)}", flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    # The peer's own logs share stdout (vLLM logs its shutdown after our line).
    return json.loads(next(line for line in out.splitlines() if line.startswith('{"engine"')))


if __name__ == "__main__":
    main()
