"""Orbax checkpoints of the serving params, for fast restarts (docs/design.md §6):
``jaxserve convert MODEL OUT --format orbax`` writes one (``convert_to_orbax``),
``load_model(OUT)`` restores it straight into each param's sharding (``restore_orbax``).

An orbax folder holds:
    params/              the orbax PyTree {our param name: array}: our layout ([in, out],
                         layers stacked), in the dtype chosen at conversion
    config.json, generation_config.json, tokenizer files: copied from MODEL
    jaxserve_orbax.json  the marker, written last: format version, dtype, param shapes

The params are stored in the checkpoint's own tp=1 shapes (no vocabulary padding, no
KV-head replicas), so one folder serves every tensor_parallel_size: the padding is
orbax's zero fill on restore (``global_shape``), and the KV replicas are one jitted
gather of k/v (a fraction of the attention width) on the devices. Storing per tp would
only add a refusal on a tp mismatch.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.atomic_folder import write_folder_atomically
from models.base import MODEL, Weight
from models.config import ModelArchConfig
from models.registry import get_model_class
from models.sharding import (
    KV_HEADS,
    arch_for_tensor_parallel,
    checkpoint_arch,
    source_indices,
)

ORBAX_MARKER = "jaxserve_orbax.json"
ORBAX_FORMAT_VERSION = 1
PARAMS_DIR = "params"
# Stored chunks stay under this size, so restoring one device's shard reads (and
# decompresses) little beyond that shard.
_CHUNK_BYTES = 16 << 20
# MODEL's files that are weights (not copied into an orbax folder).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ORBAX_MARKER).is_file()


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs a dozen INFO lines per save / restore through absl; keep warnings."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        absl.setLevel(level)


def _checkpointer():
    import orbax.checkpoint as ocp

    # Uncompressed: the folder exists for fast restarts, and decompressing cost more
    # load time (nearly twice as long on a 2-core CPU) than the disk it saved (a third).
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _stored_partition(partition: tuple, stored_shape: tuple[int, ...], tp: int) -> P:
    """Where a param whose served shape differs from the stored one is restored before
    its fix-up: its own split where the stored axis divides by tp, else the first axis
    that does (else replicated), so no device holds the whole param in between."""
    spec = [a if a != MODEL or n % tp == 0 else None for a, n in zip(partition, stored_shape)]
    if MODEL in partition and MODEL not in spec:
        for i, n in enumerate(stored_shape):
            if n % tp == 0 and spec[i] is None:
                spec[i] = MODEL
                break
    return P(*spec)


def _replicate_kv_heads(x: jax.Array, weight: Weight, arch: ModelArchConfig, sharding: NamedSharding) -> jax.Array:
    """The stored (tp=1) array laid out as served: KV head blocks repeated, placed with
    the served sharding."""
    shape = weight.shape(arch)
    picks = [source_indices(d, arch, 0, n) for d, n in zip(weight.dims, shape)]

    def expand(x):
        for axis, src in enumerate(picks):
            if not np.array_equal(src, np.arange(x.shape[axis])):
                x = jnp.take(x, jnp.asarray(src), axis=axis)
        return x

    return jax.jit(expand, out_shardings=sharding)(x)


def _read_marker(path: Path) -> dict:
    marker = json.loads((path / ORBAX_MARKER).read_text())
    if marker.get("version") != ORBAX_FORMAT_VERSION:
        raise ValueError(f"{path}: orbax folder of format version {marker.get('version')}; this jaxserve reads "
                         f"version {ORBAX_FORMAT_VERSION} (convert the model again)")
    return marker


def restore_orbax(path: str | Path, arch: ModelArchConfig, model_cls, mesh: Mesh, dtype) -> dict[str, jax.Array]:
    """{our name: jax.Array} for ``model_cls.weight_map(arch)`` (``arch`` the effective,
    tensor-parallel architecture), each restored in ``dtype`` into the sharding its
    Weight declares."""
    import orbax.checkpoint as ocp

    path = Path(path)
    marker = _read_marker(path)
    stored_arch = checkpoint_arch(arch)
    weight_map = model_cls.weight_map(arch)
    stored = {n: tuple(s) for n, s in marker["params"].items()}
    want = {n: w.shape(stored_arch) for n, w in weight_map.items()}
    if stored != want:
        diff = sorted(n for n in stored.keys() | want.keys() if stored.get(n) != want.get(n))
        raise ValueError(f"{path}: the stored params do not match config.json (e.g. {diff[:3]}: stored "
                         f"{[stored.get(n) for n in diff[:3]]}, expected {[want.get(n) for n in diff[:3]]})")
    tp = mesh.shape[MODEL]
    restore_args, replicated = {}, {}
    for name, w in weight_map.items():
        shape, target = w.shape(arch), NamedSharding(mesh, P(*w.partition))
        if arch.kv_head_replicas > 1 and any(KV_HEADS in d.split("*") for d in w.dims):
            sharding = NamedSharding(mesh, _stored_partition(w.partition, stored[name], tp))
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype)
            replicated[name] = (w, target)
        else:
            # A padded vocabulary is orbax's zero fill past the stored rows (strict=False
            # lets the shapes differ; only padded_vocab_size axes can).
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=target, global_shape=shape, dtype=dtype,
                                                      strict=shape == stored[name])
    with _quiet_orbax():
        params = _checkpointer().restore(path / PARAMS_DIR, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    for name, (w, target) in replicated.items():
        params[name] = _replicate_kv_heads(params[name], w, arch, target)
    return params


def _write_folder(model_dir: Path, folder: Path, dtype_name: str, progress: bool) -> None:
    import orbax.checkpoint as ocp

    from models.gguf_import import MARKER_FILE as GGUF_MARKER
    from models.weights import SafetensorsCheckpoint, stream_safetensors

    arch = ModelArchConfig.from_pretrained(model_dir)
    model_cls = get_model_class(arch.architecture)
    arch = arch_for_tensor_parallel(arch, 1, model_cls)  # tp=1: the stored layout
    if dtype_name == "auto":  # the checkpoint's own float dtype: no rounding, no growth
        ckpt = SafetensorsCheckpoint(model_dir)
        dtype = ckpt.dtype(model_cls.weight_map(arch)["embed_tokens"].hf_name)
        dtype_name = str(np.dtype(dtype))
        if dtype_name not in _DTYPES:
            raise ValueError(f"{model_dir}: weights in {dtype_name}; pass --dtype ({', '.join(_DTYPES)})")
    dtype = _DTYPES[dtype_name]
    # Streamed onto one host device: the converter holds the model once, in its output dtype.
    mesh = Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", MODEL))
    params = stream_safetensors(model_dir, arch, model_cls, mesh, dtype, progress=progress)
    save_args = {n: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES) for n in params}
    with _quiet_orbax():
        _checkpointer().save(folder / PARAMS_DIR, args=ocp.args.PyTreeSave(params, save_args=save_args))
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in (GGUF_MARKER, ORBAX_MARKER):
            shutil.copyfile(f, folder / f.name)
    marker = {"version": ORBAX_FORMAT_VERSION, "dtype": dtype_name, "source": str(model_dir),
              "params": {n: list(x.shape) for n, x in params.items()}}
    (folder / ORBAX_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def convert_to_orbax(model_dir: str | Path, out_dir: str | Path, *, dtype: str = "auto", overwrite: bool = False,
                     progress: bool = True) -> Path:
    """Write an orbax folder of the safetensors model in ``model_dir`` at ``out_dir``;
    ``dtype``: auto (the checkpoint's own), float32, bfloat16 or float16. The folder
    appears whole (written into a temporary sibling, renamed into place); an existing
    non-empty ``out_dir`` is an error unless ``overwrite``."""
    model_dir = Path(model_dir)
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}; got {dtype!r}")
    if is_orbax_checkpoint(model_dir):
        raise ValueError(f"{model_dir} is already an orbax folder")
    return write_folder_atomically(out_dir, lambda tmp: _write_folder(model_dir, tmp, dtype, progress),
                                   overwrite=overwrite)
