"""The warm-up's compiled programs saved whole, so that a warm start skips tracing.

JAX's persistent compilation cache skips XLA's compile, but it is keyed by the
lowered program, so every start still traces and lowers each of them: for the
default model that was most of a warm-up with every program in that cache. This cache stores the engine's executables themselves
(``jax.experimental.serialize_executable``) under a fingerprint of everything that
shapes them, and a start whose fingerprint matches loads them instead of warming up.

The fingerprint covers: jax / jaxlib versions, XLA_FLAGS and the JAX flags that
change numerics (x64, matmul precision), the devices, the whole
EngineConfig, the shapes / dtypes / shardings of the weights and KV caches, the
checkpoint files (name, size, mtime: values read from a checkpoint, such as KV
scales, may be baked into a program) and the source of the packages that build the
programs. Anything else changed means a miss and the normal warm-up. One file per
fingerprint, written atomically next to JAX's cache.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import jax

from pallas_kernels import cpu_matmul

logger = logging.getLogger("jaxserve")

_FORMAT = 1


def _package_root(pkg) -> Path:
    """The folder of a regular package. A namespace package (no ``__init__.py``, so no
    ``__file__``) means the name resolved to some other folder on ``sys.path`` (such as a
    test directory that shares the name) and its digest would hash the wrong sources."""
    if getattr(pkg, "__file__", None) is None:
        raise ImportError(
            f"{pkg.__name__!r} resolved to {list(getattr(pkg, '__path__', []))}, a folder without __init__.py, "
            f"not the project's package: a directory of that name shadows it on sys.path")
    return Path(pkg.__file__).parent


def _source_digest() -> str:
    """sha256 of every .py (and native .cc) file of the packages whose code goes into a program."""
    import jaxserve
    import models
    import pallas_kernels

    h = hashlib.sha256()
    for pkg in (jaxserve, models, pallas_kernels):
        root = _package_root(pkg)
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _files_digest(path: str | None) -> list:
    """(name, size, mtime_ns) of a checkpoint file, or of every file in its folder."""
    if not path or not os.path.exists(path):
        return [path]
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _abstract(tree: Any) -> str:
    """Shapes, dtypes and shardings of a pytree of arrays (their values do not matter)."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


def fingerprint(config: Any, model_paths: list[str | None], arrays: list[Any]) -> str:
    """Hex digest of what determines the engine's programs (see the module docstring)."""
    import jaxlib

    parts = [
        _FORMAT, jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""), jax.process_count(),
        jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
        [(d.platform, d.device_kind, d.id) for d in jax.devices()], repr(config), _source_digest(),
        [_files_digest(p) for p in model_paths], [_abstract(a) for a in arrays],
        # Programs with the native products call a custom target; asking also registers it
        # before a saved executable that calls it runs.
        cpu_matmul.enabled(),
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableCache:
    """One engine's executables by program key, in ``directory/<fingerprint>.pkl``."""

    def __init__(self, directory: str | Path, digest: str) -> None:
        self.path = Path(directory) / f"{digest}.pkl"

    def read(self, keys: list) -> dict | None:
        """The saved (serialized) executables for exactly ``keys``, or None (missing,
        unreadable, or for other keys); never raises."""
        if not self.path.exists():
            return None
        try:
            with open(self.path, "rb") as f:
                blobs = pickle.load(f)
            return blobs if set(blobs) == set(keys) else None
        except Exception as e:  # a corrupt file: warm up as usual
            logger.warning("Executable cache %s unreadable (%s: %s); compiling", self.path, type(e).__name__, e)
            return None

    @staticmethod
    def deserialize(blobs: dict, keys: list) -> dict:
        """The executables of ``keys`` from read()'s blobs, loaded onto their devices
        (raises if they cannot be)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        devices = {d.id: d for d in jax.devices()}
        # Each program runs on the devices it was compiled for, in their order (the
        # default would be every device of the backend).
        return {key: deserialize_and_load(payload, in_tree, out_tree,
                                          execution_devices=[devices[i] for i in device_ids])
                for key, (payload, in_tree, out_tree, device_ids) in ((k, blobs[k]) for k in keys)}

    def save(self, executables: dict) -> None:
        """Write every executable (atomically: a reader sees the whole file or none)."""
        from jax.experimental.serialize_executable import serialize

        try:
            if any(exe._params.const_args for exe in executables.values()):
                # Constants hoisted out of a program become its hidden arguments, which
                # serialization drops (JAX's own TODO): such a set is not saved.
                logger.info("Executable cache not written: a program has hoisted constants")
                return
            blobs = {key: (*serialize(exe), [d.id for d in exe.runtime_executable().local_devices()])
                     for key, exe in executables.items()}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(blobs, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.path)
        except Exception as e:  # a full disk or a program that cannot be serialized
            logger.warning("Executable cache not written (%s: %s)", type(e).__name__, e)
