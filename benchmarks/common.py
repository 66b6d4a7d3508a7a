"""Machine and commit lines that every benchmark prints with its numbers, and the
engine's flags for the benchmarks that build an engine (parse_engine_args)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.engine.arg_utils import EngineArgs


def machine_line() -> str:
    try:
        import jax

        dev = jax.devices()[0]
        device = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
        jax_version = jax.__version__
    except Exception:  # noqa: BLE001
        device, jax_version = "?", "?"
    return (f"machine: {platform.machine()} {os.cpu_count()} cores ({cpu_line()}), {platform.python_version()}, "
            f"jax {jax_version}, device {device}")


def cpu_line() -> str:
    """The CPU model and the vector features that change timings (AVX2 / AVX-512 / bf16 / AMX)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or "?"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}; {' '.join(feats) or 'no avx2'}"


def commit_line() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__)).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=os.path.dirname(__file__)).stdout.strip()
        return f"commit: {sha}{' (dirty)' if dirty else ''}"
    except Exception:  # noqa: BLE001
        return "commit: ?"


# ----------------------------------------------------------------------------- engine flags
_SET_BY_BENCHMARK = object()  # the default of a flag the benchmark sets itself


def parse_engine_args(parser: argparse.ArgumentParser, argv=None, *, fixed: tuple[str, ...] = (),
                      **defaults) -> tuple[argparse.Namespace, EngineArgs]:
    """Parse the benchmark's own flags plus the engine's (EngineArgs.add_cli_args: the
    names, help and checks of `jaxserve serve`).

    defaults: this benchmark's defaults for engine fields where they differ from the
    engine's (e.g. max_model_len=1024). fixed: fields the benchmark sets itself for
    each engine it builds (e.g. max_num_seqs from its batch sizes); their flags are
    hidden and refused. Returns the namespace and the EngineArgs of the flags (fixed
    fields at the engine's defaults, for the benchmark to replace)."""
    from jaxserve.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest in fixed:
            action.help = argparse.SUPPRESS
        elif action.dest in defaults:
            action.help = f"{action.help} This benchmark's default: {defaults[action.dest]}."
    parser.set_defaults(**defaults, **dict.fromkeys(fixed, _SET_BY_BENCHMARK))
    args = parser.parse_args(argv)
    given = [name for name in fixed if getattr(args, name) is not _SET_BY_BENCHMARK]
    if given:
        parser.error(f"this benchmark sets {', '.join('--' + n.replace('_', '-') for n in given)} itself")
    engine_flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in fixed})
    return args, EngineArgs.from_cli_args(engine_flags)


def engine_kwargs(engine_args: EngineArgs, **overrides) -> dict:
    """LLM(**kwargs) for ``engine_args`` with ``overrides`` (EngineArgs fields) applied."""
    return dataclasses.asdict(dataclasses.replace(engine_args, **overrides))


def run_peer_script(python: str, prompts: list[list[int]], engine: str, model: str, *flags: str,
                    every: bool = False) -> dict | list[dict]:
    """benchmarks/peer_throughput.py in the peer's own ``python`` on these token-id prompts
    (a temporary JSON file): its one JSON result line (``every``: all of them, a list)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([list(p) for p in prompts], f)
    cmd = [python, str(Path(__file__).with_name("peer_throughput.py")), "--engine", engine, "--model", model,
           "--prompts", f.name, *flags]
    print(f"Running the peer: {' '.join(cmd)}", flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    # The peer's own logs share stdout (vLLM logs its shutdown after our line).
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"engine"')]
    return rows if every else rows[0]


def plot_bars(path: str, labels: list[str], values: list[float], *, ylabel: str, title: str) -> None:
    """One bar per engine (--plot of bench_throughput.py), written to ``path`` (PNG)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    bars = ax.bar(range(len(labels)), values, color=["tab:blue" if lb.startswith("jaxserve") else "tab:gray"
                                                     for lb in labels])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(range(len(labels)), [textwrap.fill(lb, 30) for lb in labels], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lines(path: str, series: dict[str, list[tuple[float, float, float]]], *, title: str) -> None:
    """bench_serving.py --plot: for each engine its (concurrency, output tok/s, TPOT p50 ms)
    points, as two panels against concurrency, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for name, points in series.items():
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], marker="o", label=name)
        right.plot(xs, [p[2] for p in points], marker="o", label=name)
    for ax, ylabel in ((left, "output tokens/s"), (right, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
