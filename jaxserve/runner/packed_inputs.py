"""PackedLayout: a program's small host inputs as one int32 buffer, one device_put.

A step used to put each of its ~20 input arrays on the device separately. Each
transfer costs ~50-100 µs of host time whatever its size (a few hundred bytes to a
few hundred KB), so the puts alone took milliseconds per step: the largest
piece of the host's time between a step's tokens coming back and the next step
starting. Here the arrays of one program live at fixed offsets of one int32 buffer
(the host writes them in place, as views, so packing copies nothing), the buffer
crosses in one put, and the program slices them back out (slices of a few KB, free
next to the step).

Every leaf must have a 4-byte dtype (int32, uint32, float32): the others are
bitcast to int32 and back. The layout is static (shapes, dtypes, offsets), one per
program, so it is a jit static argument and a compiled program bakes it in.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

_DTYPES = ("int32", "uint32", "float32")


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of a pytree of arrays sits in a flat int32 buffer of ``size``."""

    treedef: Any  # jax.tree_util.PyTreeDef (hashable)
    leaves: tuple[tuple[tuple[int, ...], str, int, int], ...]  # (shape, dtype name, offset, size) per leaf
    size: int

    @classmethod
    def of(cls, tree: Any) -> PackedLayout:
        """The layout of ``tree`` (arrays or anything with .shape and .dtype; None
        leaves are kept as None)."""
        leaves, treedef = jax.tree.flatten(tree)
        out, offset = [], 0
        for x in leaves:
            dtype = np.dtype(x.dtype).name
            if dtype not in _DTYPES:
                raise TypeError(f"PackedLayout holds 4-byte leaves ({', '.join(_DTYPES)}); got {dtype}")
            shape = tuple(int(d) for d in x.shape)
            size = int(np.prod(shape, dtype=np.int64))
            out.append((shape, dtype, offset, size))
            offset += size
        return cls(treedef, tuple(out), offset)

    def allocate(self) -> tuple[np.ndarray, Any]:
        """A zeroed buffer [size] int32 and the tree of its views (writable numpy
        arrays of the leaves' shapes and dtypes: writing them fills the buffer)."""
        buf = np.zeros(self.size, np.int32)
        views = [buf[o:o + n].view(d).reshape(s) for s, d, o, n in self.leaves]
        return buf, jax.tree.unflatten(self.treedef, views)

    def pack(self, tree: Any) -> np.ndarray:
        """A new buffer holding ``tree``'s values (for trees built elsewhere)."""
        buf, views = self.allocate()
        for dst, src in zip(jax.tree.leaves(views), jax.tree.leaves(tree), strict=True):
            dst[...] = src
        return buf

    def unpack(self, buf: jax.Array) -> Any:
        """Inside a program: the tree back from the buffer [size] int32 (slices)."""
        assert buf.shape == (self.size,), f"buffer {buf.shape} for a layout of {self.size}"
        leaves = []
        for shape, dtype, offset, size in self.leaves:
            x = jax.lax.slice(buf, (offset,), (offset + size,))
            if dtype != "int32":
                x = jax.lax.bitcast_convert_type(x, np.dtype(dtype))
            leaves.append(x.reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)
