"""Soak (issue 14): many requests of every kind through the real server; afterwards
every KV block is free, nothing is left in flight and memory has not grown beyond a
bound. CI runs a few hundred requests; JAXSERVE_SOAK_REQUESTS=5000 is the long run,
JAXSERVE_SOAK_CONCURRENCY sets the clients, JAXSERVE_SOAK_MAX_WAITING the engine's
max_num_waiting_requests (the load at which 503s start). Prints: requests served, 503s, p50 / p99 latency, RSS before / after, free blocks."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time

import httpx
import pytest

from server.app import build_app
from tests.server.harness import RunningServer, wait_until

pytestmark = pytest.mark.slow

# RSS may grow by at most this much over the run (allocator arenas, caches that fill
# once); a leak per request (a stream, a RequestState, a detokenizer) grows with N.
RSS_GROWTH_BOUND_MB = 150


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def test_soak(tiny_async_llm, monkeypatch):
    llm = tiny_async_llm
    if "JAXSERVE_SOAK_MAX_WAITING" in os.environ:
        waiting = int(os.environ["JAXSERVE_SOAK_MAX_WAITING"])
        monkeypatch.setattr(llm, "max_in_flight", llm.max_in_flight - llm.max_num_waiting_requests + waiting)
        monkeypatch.setattr(llm, "max_num_waiting_requests", waiting)
    total = int(os.environ.get("JAXSERVE_SOAK_REQUESTS", "300"))
    concurrency = int(os.environ.get("JAXSERVE_SOAK_CONCURRENCY", "48"))
    srv = RunningServer(build_app(llm, "tiny"))
    rng = random.Random(0)
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    aborted = 0

    def body():
        kind = rng.random()
        words = " ".join(f"w{rng.randrange(3, 500)}" for _ in range(rng.randrange(1, 60)))
        common = {"model": "tiny", "max_tokens": rng.randrange(1, 24), "temperature": rng.choice([0, 0.8]),
                  "ignore_eos": True, "stream": rng.random() < 0.5}
        if kind < 0.5:
            n = rng.choice([1, 1, 2]) if common["temperature"] else 1  # greedy n > 1 is a 400
            return "/v1/completions", {**common, "prompt": words, "n": n}
        if kind < 0.9:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}
        return "/v1/completions", {**common, "prompt": words, "stop": ["w7"], "logprobs": 2}

    async def one(http, sem):
        nonlocal aborted
        path, payload = body()
        disconnect = payload["stream"] and rng.random() < 0.1
        async with sem:
            t0 = time.monotonic()
            if payload["stream"]:
                async with http.stream("POST", path, json=payload) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if disconnect:  # the client goes away after the first event
                            aborted += 1
                            break
                        if line.startswith("data: {") and '"error"' in line:
                            status = json.loads(line[6:])["error"]["code"]
            else:
                r = await http.post(path, json=payload)
                status = r.status_code
            latencies.append(time.monotonic() - t0)
            statuses[status] = statuses.get(status, 0) + 1

    async def run():
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(one(http, sem) for _ in range(total)))

    try:
        asyncio.run(run())  # warm: the first requests fill caches (tokenizer, allocator)
        gc.collect()
        before = rss_mb()
        statuses.clear()
        latencies.clear()
        t0 = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - t0
        assert wait_until(lambda: not llm.engine.has_unfinished_requests(), 30)
        gc.collect()
        after = rss_mb()
    finally:
        srv.stop()
    pool = llm.engine.engine_core.scheduler.kv_cache_manager.block_pool
    free, usable = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1
    lat = sorted(latencies)
    print(f"\nsoak: at most {llm.max_in_flight} sequences in flight; {total} requests at concurrency {concurrency} in {elapsed:.1f} s ({total / elapsed:.1f} req/s); "
          f"status counts {dict(sorted(statuses.items()))}; {aborted} client disconnects; "
          f"latency p50 {lat[len(lat) // 2]:.2f} s p99 {lat[int(len(lat) * 0.99) - 1]:.2f} s; "
          f"RSS {before:.0f} -> {after:.0f} MiB; free blocks {free}/{usable}")
    assert set(statuses) <= {200, 503}, statuses
    assert free == usable and not llm.engine.output_processor.request_states and not llm._streams
    assert after - before < RSS_GROWTH_BOUND_MB
