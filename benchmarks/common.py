"""Machine and commit lines that every benchmark prints with its numbers, and the
engine's flags for the benchmarks that build an engine (parse_engine_args)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
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
