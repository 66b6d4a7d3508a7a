"""Processes of a multi-process test: each one its own JAX with its own CPU devices
(jax.distributed must be initialised before any device use, so these runs cannot
live in the pytest process)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """``python ARGS`` in the repository root with 4 CPU devices of its own, its
    stdout / stderr in files under ``tmp`` named after ``name``."""

    def __init__(self, name: str, args: list[str], tmp: Path, devices: int = 4):
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   PYTHONUNBUFFERED="1")
        self.out_path, self.err_path = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=err)

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.out:
            if self.popen.poll() is not None:
                raise AssertionError(f"exited {self.popen.returncode} before {text!r}:\n"
                                     f"{self.out}\n{self.err[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout}s:\n{self.out}\n{self.err[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"still running after {timeout}s:\n{self.out}\n{self.err[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
