"""LoRAManager: the runner's adapters: host copies (LRU, ``max_cpu_loras``) and the
device slots (``max_loras``, LRU) a step's adapters are copied into.

The device side is one pair of buffers per target projection (models/lora.py), made
once at start with their final shapes and shardings. Copying an adapter into a slot is
one jitted program (the slot index is traced, the buffers donated and updated in
place), compiled at start: loading, evicting and reloading adapters never compiles.
Adapters are read on the caller's thread (``add``: the API's load route, a request
naming a new adapter); the engine thread only copies host arrays into slots
(``activate``), and reads an adapter from its folder again only when more adapters are
in use than ``max_cpu_loras`` keeps.
"""
from __future__ import annotations

import collections
import functools
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import LoRAConfig
from jaxserve.lora.peft import HostAdapter, read_adapter
from jaxserve.lora.request import LoRARequest
from models.config import ModelArchConfig
from models.lora import lora_targets

logger = logging.getLogger("jaxserve")


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_cls, arch: ModelArchConfig, mesh: Mesh, dtype, *,
                 as_bits: bool = False) -> None:
        """dtype: the slots' dtype (the weights': bf16 adapters for bf16 weights, whose
        products then run as the base's do; the activations' under a quantized base).
        as_bits: bfloat16 slots stored as their uint16 bit patterns (the CPU layer scan's
        convention for bf16 weights, models/llama.py; restored inside the loop)."""
        self.config = config
        self.model_cls, self.arch = model_cls, arch
        self.num_slots, self.rank = config.max_loras, config.max_lora_rank
        self.targets = lora_targets(model_cls, arch)
        if not self.targets:
            raise ValueError(f"enable_lora: {arch.architecture} has no projection LoRA adapters can target")
        shardings = {}
        for name, t in self.targets.items():
            pa, pb = t.partitions()
            shardings[name] = (NamedSharding(mesh, P(*pa)), NamedSharding(mesh, P(*pb)))
        shapes = {n: t.shapes(arch, self.num_slots, self.rank) for n, t in self.targets.items()}
        self._replicated = NamedSharding(mesh, P())

        stored = jnp.uint16 if as_bits else dtype

        def store(x):
            x = x.astype(dtype)
            return jax.lax.bitcast_convert_type(x, jnp.uint16) if as_bits else x

        @functools.partial(jax.jit, out_shardings=shardings)
        def zeros():
            return {n: (jnp.zeros(sa, stored), jnp.zeros(sb, stored)) for n, (sa, sb) in shapes.items()}

        rank = self.rank

        @functools.partial(jax.jit, donate_argnums=0, out_shardings=shardings)
        def write_slot(buffers, slot, host):
            """Slot ``slot``'s columns of every buffer <- the adapter's arrays."""
            out = {}
            for n, (a, b) in buffers.items():
                ha, hb = host[n]
                out[n] = (jax.lax.dynamic_update_slice_in_dim(a, store(ha), slot * rank, axis=2),
                          jax.lax.dynamic_update_slice_in_dim(b, store(hb), slot * rank, axis=1))
            return out

        self._write_slot = write_slot
        self.buffers = zeros()
        # The host arrays of an empty slot (what a removed adapter's slot is reset to).
        self._empty = {n: (np.zeros((sa[0], sa[1], rank), np.float32), np.zeros((sb[0], rank, sb[2]), np.float32))
                       for n, (sa, sb) in shapes.items()}
        self._lock = threading.RLock()  # add() runs on callers' threads, activate() on the engine's
        self._host: collections.OrderedDict[int, HostAdapter] = collections.OrderedDict()  # by lora_int_id, LRU
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # lora_int_id -> slot, LRU
        self.num_slot_writes = 0
        self._write(0, self._empty)  # compiles the copy now, not at the first adapter

    # ------------------------------------------------------------------ host side
    def add(self, lora: LoRARequest) -> bool:
        """Read and check the adapter (ValueError / FileNotFoundError saying what is
        wrong) unless it is held already; True when it was read now."""
        with self._lock:
            held = self._host.get(lora.lora_int_id)
            if held is not None:
                self._host.move_to_end(lora.lora_int_id)
                return False
        adapter = read_adapter(lora, self.model_cls, self.arch, self.targets, max_lora_rank=self.rank)
        with self._lock:
            if lora.lora_int_id in self._slot_of and lora.lora_int_id not in self._host:
                # The id was removed and is reused: its slot may hold the old weights.
                del self._slot_of[lora.lora_int_id]
            self._host[lora.lora_int_id] = adapter
            self._host.move_to_end(lora.lora_int_id)
            while len(self._host) > self.config.max_cpu_loras:
                evicted, _ = self._host.popitem(last=False)
                logger.info("LoRA: adapter %d dropped from host memory (max_cpu_loras=%d)", evicted,
                            self.config.max_cpu_loras)
        logger.info("LoRA: loaded adapter %r (id %d, rank %d, %s) from %s", lora.lora_name, lora.lora_int_id,
                    adapter.rank, ",".join(adapter.modules), lora.lora_path)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter's host copy (its device slot is reused as slots are needed:
        a request still running with it keeps its slot, and reads it again if needed)."""
        with self._lock:
            return self._host.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        """The ids of the adapters held on the host."""
        with self._lock:
            return set(self._host)

    # ------------------------------------------------------------------ device side
    def activate(self, loras: dict[str, LoRARequest | None], live: set[int] = frozenset()) -> dict[str, int]:
        """Slots for a step's requests (request id -> its adapter or None): the adapters
        not in a slot yet are copied into the least recently used slots no request of
        this step needs, those of adapters no live request (``live``: ids of the
        adapters of every request the runner holds) uses first. Returns request id ->
        slot + 1 (0: no adapter)."""
        wanted = {lr.lora_int_id: lr for lr in loras.values() if lr is not None}
        if len(wanted) > self.num_slots:  # the scheduler admits at most max_loras adapters per step
            raise RuntimeError(f"{len(wanted)} adapters in one step, max_loras={self.num_slots}")
        with self._lock:
            return self._activate(wanted, loras, live)

    def _activate(self, wanted: dict[int, LoRARequest], loras: dict[str, LoRARequest | None],
                  live: set[int]) -> dict[str, int]:
        for lora_id, lora in wanted.items():
            if lora_id not in self._slot_of:
                used = set(self._slot_of.values())
                free = [s for s in range(self.num_slots) if s not in used]
                if free:
                    slot = free[0]
                else:
                    idle = [i for i in self._slot_of if i not in wanted]
                    victim = next((i for i in idle if i not in live), idle[0])
                    slot = self._slot_of.pop(victim)
                self._write(slot, self._host_weights(lora))
                self._slot_of[lora_id] = slot
            self._slot_of.move_to_end(lora_id)
        return {rid: (0 if lr is None else self._slot_of[lr.lora_int_id] + 1) for rid, lr in loras.items()}

    def _host_weights(self, lora: LoRARequest) -> dict:
        with self._lock:
            adapter = self._host.get(lora.lora_int_id)
        if adapter is None:  # dropped from host memory since (more adapters than max_cpu_loras)
            self.add(lora)
            with self._lock:
                adapter = self._host[lora.lora_int_id]
        return adapter.weights

    def _write(self, slot: int, weights: dict) -> None:
        host = jax.device_put(weights, self._replicated)
        self.buffers = self._write_slot(self.buffers, np.int32(slot), host)
        self.num_slot_writes += 1

    @property
    def device_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.buffers.values())
