"""Online serving benchmark, `vllm bench serve`-style (docs/vllm_behaviours.md §11: BM-01..BM-08).

Streams /v1/completions requests with random prompts of a fixed input length and a
fixed output length (ignore_eos), at a given max concurrency (all requests are sent at
t=0, a semaphore caps how many are in flight), and reports TTFT / TPOT / ITL / E2EL
(mean, median, P99) and throughputs.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 8
    python benchmarks/bench_serving.py --launch ...   # starts `serve` itself (default model)

Against vLLM's own server (the CPU build, in its own venv), same client, same prompts:
the peer is launched first, every concurrency runs against it, it is stopped, then ours:

    python benchmarks/bench_serving.py --peer vllm --peer-python ../vllm-venv/bin/python \
        --max-concurrency 1 8 32 64 --num-prompts 4 16 64 128

Prompts are sent as token-id lists, so the input length is exact: random ids drawn as
vLLM's random dataset does (the vocabulary minus special tokens, offset per request).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # to the last chunk with choices (the usage chunk is excluded)
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0  # the HTTP status (a 503 is the server refusing load, see --max-num-waiting-requests)


# ----------------------------------------------------------------------------- prompts
def _vocab_info(root: str | None, tokenizer: str | None) -> tuple[int, list[int]]:
    """(vocab size, special token ids) from the served model's tokenizer."""
    from transformers import AutoTokenizer

    path = tokenizer or root
    if path is None:
        raise SystemExit("the server's /v1/models has no `root`; pass --tokenizer")
    tok = AutoTokenizer.from_pretrained(path)
    return len(tok), sorted(set(tok.all_special_ids))


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, special_ids: list[int], seed: int):
    """vLLM's random dataset: allowed[(offset + i + arange(len)) % |allowed|]."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    offsets = rng.integers(0, len(allowed), size=num_prompts)
    return [allowed[(int(off) + i + np.arange(input_len)) % len(allowed)].tolist() for i, off in enumerate(offsets)]


# ----------------------------------------------------------------------------- one request
async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                       request_id: str) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "logprobs": None,
            "repetition_penalty": 1.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_len=len(prompt))
    st = time.perf_counter()
    res.start = st
    last = st
    try:
        async with client.stream("POST", url, json=body, headers={"x-request-id": request_id}) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:500]
                return res
            buf = ""
            async for text in r.aiter_text():
                buf += text
                while "\n\n" in buf:
                    event, buf = buf.split("\n\n", 1)
                    event = event.strip()
                    if not event or event.startswith(":"):
                        continue
                    data = event.removeprefix("data: ").strip()
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = json.dumps(chunk["error"])[:500]
                        return res
                    now = time.perf_counter()
                    if chunk.get("choices"):
                        if res.ttft == 0.0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunk_times.append(now)
                    elif chunk.get("usage"):
                        res.output_tokens = chunk["usage"].get("completion_tokens") or 0
        res.latency = last - st
        res.success = res.ttft > 0
        if not res.success:
            res.error = "no chunk with choices"
    except Exception as e:  # noqa: BLE001 — a failed request is reported, not fatal
        res.error = repr(e)
    return res


# ----------------------------------------------------------------------------- the run
def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else 0.0


async def benchmark(*, base_url: str, model: str | None = None, num_prompts: int = 32, input_len: int = 128,
                    output_len: int = 64, max_concurrency: int | None = 1, seed: int = 0,
                    tokenizer: str | None = None, num_warmups: int = 1, verbose: bool = False) -> dict:
    """Run one benchmark against a running server; returns vLLM's result keys."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max(max_concurrency or num_prompts, 1) + 4,
                          max_keepalive_connections=max(max_concurrency or num_prompts, 1) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        card = (await client.get(f"{base_url}/v1/models")).json()["data"][0]
        model = model or card["id"]
        vocab_size, special = _vocab_info(card.get("root"), tokenizer)
        prompts = random_prompts(num_prompts, input_len, vocab_size, special, seed)
        url = f"{base_url}/v1/completions"
        test = await send_request(client, url, model, prompts[0], min(output_len, 8), "bench-test")
        if not test.success:
            raise RuntimeError(f"the test request failed: {test.error}")
        for i in range(num_warmups):
            await send_request(client, url, model, prompts[i % len(prompts)], output_len, f"bench-warmup-{i}")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        in_flight = 0
        peak_in_flight = 0

        async def limited(i, p):
            nonlocal in_flight, peak_in_flight
            if sem is None:
                in_flight += 1
                peak_in_flight = max(peak_in_flight, in_flight)
                try:
                    return await send_request(client, url, model, p, output_len, f"bench-{i}")
                finally:
                    in_flight -= 1
            async with sem:
                in_flight += 1
                peak_in_flight = max(peak_in_flight, in_flight)
                try:
                    return await send_request(client, url, model, p, output_len, f"bench-{i}")
                finally:
                    in_flight -= 1

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0

    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    if verbose:
        for r in [r for r in failed if r.status != 503][:5]:
            print("failed request:", r.error, file=sys.stderr)
    out_lens = [r.output_tokens for r in ok]
    in_lens = [r.prompt_len for r in ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    # Peak output tokens/s over 1-second buckets (chunks ~ tokens for streaming).
    buckets: dict[int, int] = {}
    for r in ok:
        for t in r.chunk_times:
            k = int(t - t0)
            buckets[k] = buckets.get(k, 0) + 1
    result = {
        "completed": len(ok), "failed": len(failed), "rejected_503": sum(r.status == 503 for r in failed),
        "max_concurrency": max_concurrency, "duration": duration,
        "total_input_tokens": sum(in_lens), "total_output_tokens": sum(out_lens),
        "request_throughput": len(ok) / duration, "output_throughput": sum(out_lens) / duration,
        "total_token_throughput": (sum(in_lens) + sum(out_lens)) / duration,
        "max_output_tokens_per_s": float(max(buckets.values())) if buckets else 0.0,
        "max_concurrent_requests": peak_in_flight,
        "input_lens": in_lens, "output_lens": out_lens, "ttfts": ttfts, "itls": [r.itl for r in ok],
        "errors": [r.error for r in failed],
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = [x * 1000 for x in xs]
        result[f"mean_{name}_ms"] = float(np.mean(ms)) if ms else 0.0
        result[f"median_{name}_ms"] = float(np.median(ms)) if ms else 0.0
        result[f"std_{name}_ms"] = float(np.std(ms)) if ms else 0.0
        result[f"p99_{name}_ms"] = _pct(ms, 99)
    return result


# ----------------------------------------------------------------------------- report
def machine_line() -> str:
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"machine: {platform.node()} | {cpu} x{os.cpu_count()} | python {platform.python_version()} | commit {commit}"


def print_report(r: dict, *, backend_info: str = "") -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", r["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", r["failed"]))
    print("{:<40} {:<10}".format("  of which refused (503):", r["rejected_503"]))
    if r["max_concurrency"]:
        print("{:<40} {:<10}".format("Maximum request concurrency:", r["max_concurrency"]))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", r["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", r["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", r["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", r["request_throughput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", r["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]))
    print("{:<40} {:<10.2f}".format("Peak concurrent requests:", r["max_concurrent_requests"]))
    print("{:<40} {:<10.2f}".format("Total token throughput (tok/s):", r["total_token_throughput"]))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        label = name.upper()
        print("{:<40} {:<10.2f}".format(f"Mean {label} (ms):", r[f"mean_{name}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {label} (ms):", r[f"median_{name}_ms"]))
        print("{:<40} {:<10.2f}".format(f"P99 {label} (ms):", r[f"p99_{name}_ms"]))
    print("=" * 50)
    print(machine_line() + (f" | {backend_info}" if backend_info else ""))


# ----------------------------------------------------------------------------- --launch
def server_rss_mb(proc: subprocess.Popen | None) -> float:
    """The launched server's resident memory (nan when not launched here)."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (AttributeError, OSError, StopIteration):
        return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(args) -> tuple[subprocess.Popen, str]:
    """Our `serve` on a free port; returns once /health answers (the start-up is printed)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "server.cli_serve", "serve", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--disable-log-requests", "--uvicorn-log-level", "warning",
           # Every program compiled before /health answers (as vLLM's server does), so the
           # runs do not measure a background warm-up (--server-args can turn it back on).
           "--no-background-warmup"]
    cmd += _shared_server_args(args)
    cmd += args.server_args.split() if args.server_args else []
    return _wait_healthy(args, cmd, port, env=None)


def _shared_server_args(args) -> list[str]:
    """With --peer, both servers get the same batch and context limits."""
    if not args.peer:
        return []
    return ["--max-num-seqs", str(max(args.max_concurrency)), "--max-model-len", str(args.max_model_len)]


def launch_peer(args) -> tuple[subprocess.Popen, str]:
    """`vllm serve` (its OpenAI server module) from the peer's Python on the model we serve,
    in --peer-dtype (its own default unless given), seed 0, with the CPU build's KV space
    and thread binding (set unless given)."""
    sys.path.insert(0, str(REPO))
    from models.default_model import default_model_dir

    port = _free_port()
    model = args.model or str(default_model_dir())
    cmd = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.peer_dtype, "--seed", "0", "--uvicorn-log-level", "warning",
           *_shared_server_args(args)]
    cmd += args.peer_args.split() if args.peer_args else []
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    return _wait_healthy(args, cmd, port, env=env)


def _wait_healthy(args, cmd: list[str], port: int, env) -> tuple[subprocess.Popen, str]:
    print("launching:", " ".join(cmd), file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                print(f"server healthy after {time.monotonic() - t0:.1f} s", file=sys.stderr)
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not become healthy in time")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: /v1/models data[0].id); "
                                                 "with --launch, the MODEL to serve (default: embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the vocabulary (default: the model's root)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=[32],
                   help="prompts per run; one value per --max-concurrency value, or one for all")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1], help="one run per value")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch", action="store_true", help="start `serve` on a free port for the run")
    p.add_argument("--server-args", default="", help="extra arguments for the launched server (one string)")
    p.add_argument("--launch-timeout", type=float, default=600)
    p.add_argument("--save-result", default=None, help="write all results to this JSON file")
    p.add_argument("--peer", choices=("vllm",), default=None,
                   help="first launch this engine's server (vLLM: its OpenAI server, CPU build) on the same model "
                        "and run every concurrency against it, then ours (launched): both and the ratios")
    p.add_argument("--peer-python", default=sys.executable, help="the Python of the peer's environment")
    p.add_argument("--peer-dtype", default="auto",
                   help="the peer's --dtype: auto (default: its own, bfloat16 for vLLM on an x86 CPU), float32 "
                        "(like for like) or bfloat16")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw output tok/s and TPOT p50 against concurrency, each engine a line (matplotlib)")
    p.add_argument("--peer-args", default="", help="extra arguments for the peer's server (one string)")
    p.add_argument("--max-model-len", type=int, default=1024, help="with --peer: both servers' context limit "
                                                                   "(and max-num-seqs = the largest concurrency)")
    args = p.parse_args(argv)
    nps = args.num_prompts if len(args.num_prompts) > 1 else args.num_prompts * len(args.max_concurrency)
    if len(nps) != len(args.max_concurrency):
        raise SystemExit("--num-prompts: one value, or one per --max-concurrency value")
    peer = None
    if args.peer:  # first, so that its start-up and run share nothing with ours
        print(f"== peer: {args.peer} ==", flush=True)
        peer = run_all(args, nps, launch=functools.partial(launch_peer, args))
        print("== jaxserve ==", flush=True)
    ours = run_all(args, nps, launch=functools.partial(launch_server, args) if args.launch or args.peer else None)
    if peer is not None:
        print(f"\n| concurrency | prompts | engine | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s |")
        print("|---|---|---|---|---|---|")
        for r_peer, r, n in zip(peer, ours, nps):
            for name, x in ((args.peer, r_peer), ("jaxserve", r)):
                print(f"| {x['max_concurrency']} | {n} | {name} | {x['median_ttft_ms']:.0f} / {x['p99_ttft_ms']:.0f} | "
                      f"{x['median_tpot_ms']:.1f} / {x['p99_tpot_ms']:.1f} | {x['output_throughput']:.1f} |")
        for r_peer, r in zip(peer, ours):
            ratio = r["output_throughput"] / r_peer["output_throughput"] if r_peer["output_throughput"] else float("nan")
            print(f"concurrency {r['max_concurrency']}: jaxserve / {args.peer} output tok/s {ratio:.2f}x")
        print(machine_line())
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import plot_lines

        series = {"jaxserve": ours} | ({f"{args.peer} --dtype {args.peer_dtype}": peer} if peer else {})
        plot_lines(args.plot, {name: [(r["max_concurrency"] or r["completed"], r["output_throughput"], r["median_tpot_ms"])
                                      for r in runs] for name, runs in series.items()},
                   title=f"{args.input_len} tokens in, {args.output_len} out; {machine_line()}")
        print(f"chart: {args.plot}")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"jaxserve": ours, "peer": peer} if peer else ours, indent=1))


def run_all(args, nps: list[int], launch) -> list[dict]:
    """Every --max-concurrency run against one server (launched by ``launch`` when given,
    else --base-url), stopped afterwards; prints each report and a summary table."""
    proc, base_url = launch() if launch else (None, args.base_url)
    try:
        results = []
        rss = [server_rss_mb(proc)]
        for conc, n in zip(args.max_concurrency, nps):
            r = asyncio.run(benchmark(base_url=base_url, model=None if launch else args.model,
                                      num_prompts=n, input_len=args.input_len, output_len=args.output_len,
                                      max_concurrency=conc, seed=args.seed, tokenizer=args.tokenizer,
                                      num_warmups=args.num_warmups, verbose=True))
            print_report(r)
            results.append(r)
            rss.append(server_rss_mb(proc))
        if len(results) > 1:
            print("\n| concurrency | prompts | TTFT mean/median/p99 (ms) | TPOT mean/median/p99 (ms) | output tok/s "
                  "| req/s | 503s | other failures | server RSS after (MiB) |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r, n, mb in zip(results, nps, rss[1:]):
                print(f"| {r['max_concurrency']} | {n} | {r['mean_ttft_ms']:.1f} / {r['median_ttft_ms']:.1f} / "
                      f"{r['p99_ttft_ms']:.1f} | {r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f} / "
                      f"{r['p99_tpot_ms']:.1f} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} "
                      f"| {r['rejected_503']} | {r['failed'] - r['rejected_503']} | {mb:.0f} |")
            print(f"server RSS before the runs: {rss[0]:.0f} MiB")
        return results
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
