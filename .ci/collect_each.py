#!/usr/bin/env python3
"""Each test file collected alone, in its own process, as a contributor runs one file.

`.venv/bin/pytest FILE` (the console script: no current directory on sys.path) once put
tests/models ahead of the project's `models` package and failed; the whole suite hid it.
tests/test_architecture.py checks where the project's packages resolve, and the
conftest's import guard fails collection when they resolve elsewhere, so collecting
each file alone is enough to see it. Two processes at a time (the CI machine's cores).
"""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(path: Path) -> tuple[Path, int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([str(ROOT / ".venv/bin/pytest"), "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(path.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return path, p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def main() -> int:
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    t0 = time.monotonic()
    failed = []
    with ThreadPoolExecutor(2) as pool:
        for path, rc, out, dt in pool.map(collect, files):
            if rc != 0:
                failed.append(path)
                print(f"FAILED to collect alone: {path.relative_to(ROOT)} (exit {rc})\n{out[-3000:]}", flush=True)
    print(f"collect-each: {len(files) - len(failed)} of {len(files)} test files collect alone "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
