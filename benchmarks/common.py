"""Machine and commit lines that every benchmark prints with its numbers."""
from __future__ import annotations

import os
import platform
import subprocess


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
