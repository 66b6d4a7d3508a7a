"""The research loop's costs on one engine: update_weights from (a) the engine's own
param pytree, (b) a name -> array dict, (c) the model's folder; sleep / wake_up at
levels 1 and 2 with the memory they give back; and the compiles all of it made (none
expected).

    python benchmarks/bench_weight_update.py                 # the default model, default settings
    python benchmarks/bench_weight_update.py --repeats 10 --dtype float32

Each time is the median of ``--repeats`` calls (wall clock, the arrays ready). Memory:
the bytes of the arrays on the devices (``memory_usage``) and the process's RSS (on CPU
the devices' memory is the process's). Greedy outputs before and after are compared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds, last result) of ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args, engine_args = parse_engine_args(ap, argv)
    import jax
    from safetensors.numpy import load_file

    from jaxserve import LLM, SamplingParams

    print(machine_line())
    print(commit_line())
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(duration)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(engine_args))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    folder = Path(llm.config.model_config.model)
    runner = llm.llm_engine.model_runner
    prompts = [f"Give me {n} facts about the sea." for n in range(1, 9)]
    sp = SamplingParams(temperature=0, max_tokens=32)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    before = tokens()
    n0 = len(compiles)
    rows = []
    read_s, arrays = timed(lambda: load_file(str(folder / "model.safetensors")), 1)
    mib = sum(a.nbytes for a in arrays.values()) / 2**20
    for name, weights in [("own pytree (get_params)", lambda: llm.get_params()),
                          (f"name -> numpy dict ({len(arrays)} tensors, {mib:.0f} MiB)", lambda: arrays),
                          ("folder (safetensors)", lambda: str(folder))]:
        seconds, _ = timed(lambda: llm.update_weights(weights()), args.repeats)
        rows.append((f"update_weights: {name}", seconds))
    mem0, rss0 = runner.memory_usage(), rss_mib()
    rows.append(("sleep(1)", timed(lambda: llm.sleep(1), 1)[0]))
    mem1, rss1 = runner.memory_usage(), rss_mib()
    rows.append(("wake_up() after level 1", timed(llm.wake_up, 1)[0]))
    rows.append(("sleep(2)", timed(lambda: llm.sleep(2), 1)[0]))
    mem2, rss2 = runner.memory_usage(), rss_mib()
    rows.append(("wake_up() after level 2 (weights re-read from the folder)", timed(llm.wake_up, 1)[0]))
    after = tokens()
    print(f"\nsafetensors -> numpy dict (not counted above): {read_s * 1e3:.0f} ms")
    print("\n| operation | seconds |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} ms |" if seconds < 1 else f"| {name} | {seconds:.2f} s |")
    print("\n| state | weights on device (MiB) | KV cache on device (MiB) | RSS (MiB) |\n|---|---|---|---|")
    for name, mem, rss in (("awake", mem0, rss0), ("sleep(1)", mem1, rss1), ("sleep(2)", mem2, rss2)):
        print(f"| {name} | {mem['weights'] / 2**20:.1f} | {mem['kv_cache'] / 2**20:.1f} | {rss:.0f} |")
    print(f"\ncompiles during updates, sleep and wake: {len(compiles) - n0}")
    print(f"greedy outputs after == before: {after == before}")


if __name__ == "__main__":
    main()
