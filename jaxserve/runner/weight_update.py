"""Live weight updates and sleep / wake for the runner (the research loop, docs/research_loop.md).

``WeightUpdater.update(weights)`` puts new values into the served params without
touching the compiled programs: every program takes the params as an argument, so new
arrays of the same shapes, dtypes and shardings run through the same executables
(nothing recompiles). Three sources:

- a folder (safetensors or an orbax folder from ``jaxserve convert --format orbax``):
  loaded by the start-up loader itself (models/loader.py), so the new params are exactly
  what a fresh engine on that folder would hold (quantized, bf16 bit patterns, ...);
- a mapping of HF checkpoint names to arrays, whole or a subset: read by the loader's
  shard readers (models/param_update.py), then stored as the model stores them here
  (re-quantized, bf16 bit patterns for the CPU layer scan, one array per layer when
  unrolled); a subset of a stacked param's layers is written into it with one scatter;
- the engine's own param pytree (``get_params()``: an ``nnx.State`` of the params, or
  its ``nnx.to_pure_dict``), whole or a subset: arrays with the same shape, dtype and
  sharding are taken as they are (no copy, nothing through the host); another float
  dtype is cast and another sharding resharded on the devices.

Everything is read, checked and built before the first param is replaced, so a failed
update (a bad name, shape or dtype; an unreadable file) leaves the old weights serving.
The engine calls it between steps with no request holding KV (jaxserve/engine/core.py),
and resets the prefix cache after it.

Sleep (vLLM's levels): 1 frees the KV cache, 2 also the weights. Waking re-allocates
the KV cache (zeros, by a program compiled once) and, after level 2, reloads the weights
from the folder they last came from (the model, or the last folder update), unless an
update while asleep gave them; weights that came from arrays since cannot be re-read,
and waking asks for an update first.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.param_update import ArrayCheckpoint, plan_update, read_update
from models.quantization import GROUP_SCALED, quantized_names, quantizer
from models.registry import get_model_class
from pallas_kernels.storage import BF16_BITS, to_bf16_bits

logger = logging.getLogger("jaxserve")

Path_ = tuple  # a param's path in the state, e.g. ("layers", "q_proj") or ("layers", 3, "q_proj")


def _path_str(path: Path_) -> str:
    return "/".join(str(p) for p in path)


@jax.jit
def _set_layers(stacked, part, layers):
    """stacked [L, ...] with rows ``layers`` replaced by part [len(layers), ...]."""
    return stacked.at[layers].set(part)


def _stored_as(value: jax.Array, dtype) -> jax.Array:
    """``value`` as a leaf of ``dtype`` stores it: bfloat16 as its uint16 bit patterns
    (the CPU layer scan's storage), another dtype cast."""
    if jnp.dtype(dtype) == BF16_BITS and value.dtype != BF16_BITS:
        return to_bf16_bits(value.astype(jnp.bfloat16))
    return value if value.dtype == dtype else value.astype(dtype)


class WeightUpdater:
    """The runner's params as updatable leaves (see the module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.model_cls = get_model_class(runner.arch.architecture)
        self.version = 0  # bumped by every update (the server reports it)
        # The folder the served weights can be re-read from (None once arrays replaced any).
        self.source: str | None = runner.model_path
        self.weights_freed = False
        # Every param leaf: (shape, dtype, sharding), recorded once (they never change).
        self.specs: dict[Path_, tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding]] = {}
        # Param name -> its leaves: (path, layer) with layer None for a whole leaf, or i
        # for layer i's own array (unrolled layers).
        self.leaves_of: dict[str, list[tuple[Path_, int | None]]] = {}
        for path, var in nnx.to_flat_state(runner.state):
            if not isinstance(var, nnx.Param):
                continue
            value = var.get_value()
            self.specs[path] = (tuple(value.shape), value.dtype, value.sharding)
            layer = path[1] if len(path) == 3 and isinstance(path[1], int) else None
            self.leaves_of.setdefault(path[-1], []).append((path, layer))
        arch = runner.arch
        self._quantized = set(quantized_names(self.model_cls.weight_map(arch))) if arch.quantization else set()
        self._quantize = (quantizer(self.model_cls.weight_map(arch), runner.mesh, arch.quantization)
                          if arch.quantization in ("int8", "fp8") else None)

    @functools.cached_property
    def _arch_fields(self) -> dict:
        """The served model's configuration, read on the first folder update (not at start)."""
        from models.config import ModelArchConfig

        return _arch_fields(ModelArchConfig.from_pretrained(self.runner.model_path,
                                                         self.runner.config.model_config.hf_overrides))

    # ------------------------------------------------------------------ reading
    def get_params(self) -> nnx.State:
        """The served params (nnx.Param leaves only) as an nnx.State: the engine's own
        arrays, no copy."""
        if self.weights_freed:
            raise RuntimeError("the weights are freed (sleep level 2): wake_up() or update_weights() first")
        return nnx.filter_state(self.runner.state, nnx.Param)

    def total_bytes(self) -> int:
        """Bytes of the params on the devices (every shard; 0 while freed)."""
        if self.weights_freed:
            return 0
        return sum(device_bytes(v.get_value()) for _, v in nnx.to_flat_state(nnx.filter_state(self.runner.state, nnx.Param)))

    # ------------------------------------------------------------------ update
    def update(self, weights) -> dict:
        """Replace the params ``weights`` gives (see the module docstring); returns
        {"version", "num_params", "seconds", "source"}."""
        t0 = time.perf_counter()
        if self.runner.arch.quantization in GROUP_SCALED:
            raise ValueError(f"update_weights: the model is served with its packed checkpoint's weights kept as "
                             f"stored ({self.runner.arch.quantization}: --quantization awq / gptq / compressed-tensors "
                             "/ fp8 / mxfp4, or TPU / GPU), which an update cannot replace; serve a float "
                             "checkpoint to update its weights")
        kind = weights_kind(weights)
        source = str(weights) if kind == "folder" else None
        read = {"folder": lambda: self._from_folder(Path(weights)), "pytree": lambda: self._from_pytree(weights),
                "arrays": lambda: self._from_arrays(weights)}

        def build():
            new = read[kind]()
            if self.weights_freed and set(new) != set(self.specs):
                missing = sorted(_path_str(p) for p in set(self.specs) - set(new))
                raise ValueError(f"update_weights: the weights are freed (sleep level 2), so an update must give "
                                 f"every param; missing {len(missing)}, e.g. {missing[:3]}")
            return new

        new = self._build_everywhere(build)
        self._apply(new)
        self.version += 1
        self.source = source if kind == "folder" else None
        seconds = time.perf_counter() - t0
        logger.info("Updated %d param arrays from %s in %.2f s (weights version %d)", len(new),
                    source or kind, seconds, self.version)
        return {"version": self.version, "num_params": len(new), "seconds": seconds, "source": kind}

    @staticmethod
    def _build_everywhere(build) -> dict[Path_, jax.Array]:
        """``build()``'s new leaves, ready, once every process has built its own: in a
        multi-host run all processes keep their old weights unless all have the new ones
        (a folder missing on one host must not leave the others serving other weights).
        The error of this process, or a RuntimeError naming another's failure."""
        try:
            new = jax.block_until_ready(build())
            error = None
        except Exception as e:  # noqa: BLE001 — re-raised below, once the other processes know
            new, error = None, e
        if not _all_processes_agree(error is None):
            raise error or RuntimeError("update_weights failed on another process (its log says why); "
                                        "the old weights keep serving")
        return new

    def _apply(self, new: dict[Path_, jax.Array]) -> None:
        """Swap the new leaves in (cannot fail: every check ran before)."""
        flat = [(p, v.replace(new[p]) if p in new else v) for p, v in nnx.to_flat_state(self.runner.state)]
        self.runner.state = nnx.from_flat_state(flat)
        self.weights_freed = False

    def _checked(self, path: Path_, value: jax.Array, what: str) -> jax.Array:
        """``value`` as the leaf at ``path`` holds it: its shape (ValueError otherwise),
        dtype (floats cast on the devices) and sharding (resharded on the devices)."""
        shape, dtype, sharding = self.specs[path]
        if tuple(value.shape) != shape:
            raise ValueError(f"update_weights: {what} has shape {tuple(value.shape)}; the served param has {shape}")
        if value.dtype != dtype:
            floats = jnp.issubdtype(value.dtype, jnp.floating) and (
                jnp.issubdtype(dtype, jnp.floating) or dtype == BF16_BITS)
            if not floats:
                raise ValueError(f"update_weights: {what} has dtype {value.dtype}; the served param is {dtype}")
            value = _stored_as(value, dtype)
        if not value.sharding.is_equivalent_to(sharding, len(shape)):
            value = jax.device_put(value, sharding)
        return value

    def _from_pytree(self, tree) -> dict[Path_, jax.Array]:
        if isinstance(tree, nnx.State):
            flat = [(tuple(p), v) for p, v in nnx.to_flat_state(tree)]
        else:
            flat = list(_flatten(tree))
        new = {}
        for path, leaf in flat:
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            if path not in self.specs:
                raise ValueError(f"update_weights: {_path_str(path)!r} is not a param of the served model "
                                 f"(get_params() gives the structure, e.g. {_path_str(next(iter(self.specs)))!r})")
            if not isinstance(value, jax.Array):
                value = np.asarray(value)
                if not jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != self.specs[path][1]:
                    raise ValueError(f"update_weights: {_path_str(path)!r} has dtype {value.dtype}; "
                                     f"the served param is {self.specs[path][1]}")
                value = jax.device_put(value, self.specs[path][2])
            new[path] = self._checked(path, value, repr(_path_str(path)))
        return new

    def _from_arrays(self, arrays: Mapping) -> dict[Path_, jax.Array]:
        ckpt = ArrayCheckpoint(arrays)
        plan = plan_update(ckpt, self.runner.arch, self.model_cls)
        if not plan:
            raise ValueError("update_weights: the mapping names no parameter of the model")
        for u in plan:
            if u.layers is not None and self.weights_freed:
                raise ValueError(f"update_weights: the weights are freed (sleep level 2); {u.name!r} names only "
                                 f"layers {list(u.layers)}")
        dtypes = {u.name: self._read_dtype(u.name) for u in plan}
        values = read_update(ckpt, plan, self.runner.arch, self.model_cls, self.runner.mesh, dtypes)
        new = {}
        for u in plan:
            value = values.pop(u.name)
            pieces = self._quantize(u.name, value) if u.name in self._quantized else {u.name: value}
            for name, piece in pieces.items():
                for path, layer in self.leaves_of[name]:
                    stored = _stored_as(piece, self.specs[path][1])
                    if layer is not None:  # one array per layer (unrolled)
                        if u.layers is not None and layer not in u.layers:
                            continue
                        stored = stored[layer if u.layers is None else u.layers.index(layer)]
                    elif u.layers is not None:  # some layers of a stacked param
                        current = _get(self.runner.state, path)
                        stored = _set_layers(current, stored, jnp.asarray(u.layers, jnp.int32))
                    new[path] = self._checked(path, stored, f"{name!r}")
        return new

    def _read_dtype(self, name: str):
        """The dtype the loader reads ``name`` in: the serving dtype for a param it then
        quantizes, else the served leaf's (bfloat16 for a leaf of its bit patterns)."""
        if name in self._quantized:
            return self.runner.dtype
        dtype = self.specs[self.leaves_of[name][0][0]][1]
        return jnp.bfloat16 if dtype == BF16_BITS else dtype

    def _from_folder(self, folder: Path) -> dict[Path_, jax.Array]:
        """Every param, loaded from ``folder`` by the start-up loader."""
        from models.config import ModelArchConfig
        from jaxserve.runner.setup import load_target_model

        if not (folder / "config.json").is_file():
            raise ValueError(f"update_weights: {folder} is not a model folder (no config.json)")
        runner = self.runner
        ours = self._arch_fields  # the served model's --hf-overrides apply to the folder too
        theirs = _arch_fields(ModelArchConfig.from_pretrained(folder, runner.config.model_config.hf_overrides))
        if theirs != ours:
            diff = {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}
            raise ValueError(f"update_weights: {folder}'s config.json describes another model (differs in "
                             f"{diff} as (served, folder)); an update keeps the model's configuration")
        _, _, state = load_target_model(runner.config, str(folder), runner.mesh, runner.dtype, runner.param_dtype,
                                        progress=False)
        new = {}
        for path, var in nnx.to_flat_state(state):
            if path in self.specs:
                new[path] = self._checked(path, var.get_value(), repr(_path_str(path)))
        missing = set(self.specs) - set(new)
        if missing:
            raise ValueError(f"update_weights: {folder} gave no {sorted(map(_path_str, missing))[:3]}")
        return new

    # ------------------------------------------------------------------ sleep / wake
    def free_weights(self) -> int:
        """Drop the engine's references to every param's arrays (sleep level 2): their
        memory goes back unless someone else holds them (a trainer's arrays handed over
        with no copy stay the trainer's: nothing is deleted under it). Returns the bytes
        the engine held."""
        freed = self.total_bytes()
        self.runner.state = nnx.from_flat_state([
            (p, v.replace(_abstract(*self.specs[p])) if p in self.specs else v)
            for p, v in nnx.to_flat_state(self.runner.state)])
        self.weights_freed = True
        return freed

    def reload_weights(self) -> None:
        """After free_weights: the params again, from the folder they last came from."""
        if not self.weights_freed:
            return
        if self.source is None:
            raise RuntimeError("wake_up: the weights were freed (sleep level 2) and last came from arrays, which "
                               "cannot be re-read; call update_weights() with the weights first")
        self._apply(self._build_everywhere(lambda: self._from_folder(Path(self.source))))


def check_sleep_level(level) -> None:
    if level not in (1, 2):
        raise ValueError(f"level: 1 (free the KV cache) or 2 (the weights too), got {level!r}")


def weights_kind(weights) -> str:
    """What ``update_weights`` was given: "folder", "pytree" (the engine's param
    structure) or "arrays" (HF names -> arrays); TypeError otherwise."""
    if isinstance(weights, (str, os.PathLike)):
        return "folder"
    # HF checkpoint names always have a dot ("lm_head.weight"); the engine's top-level
    # param names never do ("embed_tokens").
    if isinstance(weights, nnx.State) or (isinstance(weights, Mapping) and weights and (
            any(isinstance(v, (Mapping, nnx.Variable)) for v in weights.values())
            or all(isinstance(k, str) and "." not in k for k in weights))):
        return "pytree"
    if isinstance(weights, Mapping):
        return "arrays"
    raise TypeError(f"weights: a folder path, a mapping of HF checkpoint names to arrays, or the engine's param "
                    f"pytree (get_params()), got {type(weights).__name__}")


def _all_processes_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (one all-gather of a flag in a multi-host
    run; each process calls this at the same point: the runner calls replay in order)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def replayable(weights):
    """``weights`` as the step channel sends it to the other processes of a multi-host
    run (each reads its own devices' shards): a folder's path, or the arrays on the host.
    A param pytree is refused: its arrays already span the processes' devices."""
    kind = weights_kind(weights)
    if kind == "pytree":
        raise ValueError("update_weights: a param pytree is not replayed to other processes; in a multi-host "
                         "run pass a folder or a mapping of HF names to arrays")
    return str(weights) if kind == "folder" else {k: np.asarray(v) for k, v in weights.items()}


def _arch_fields(arch) -> dict:
    """What config.json fixes in the served model: the shapes, and what the programs and
    the non-param state bake in (rope, norms' epsilon, soft caps, windows). The KV cache
    scales are the checkpoint's, read at start: an update keeps them."""
    fields = dataclasses.asdict(arch)
    fields.pop("kv_cache_scales", None)
    return fields


def device_bytes(value: jax.Array) -> int:
    """Bytes of ``value`` on this process's devices (every shard; 0 once deleted)."""
    return 0 if value.is_deleted() else sum(s.data.nbytes for s in value.addressable_shards)


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _get(state, path):
    node = state
    for p in path:
        node = node[p]
    return node.get_value() if isinstance(node, nnx.Variable) else node


def _flatten(tree, prefix=()):
    """(path, leaf) of a nested mapping (nnx.to_pure_dict of an nnx.State)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value
