"""Batch-invariant mode's building block: row-wise work in one fixed shape.

XLA picks a product's blocking, and a reduction's vectorization and threading, from the
shapes it is given, so a row's result can change with the number of rows beside it: on
a 2-core Zen 4 VM an RMSNorm over [T, 576] rows gave other last bits for the same row
at T >= 4096 than at T <= 2048, and a float32 product of 576 x 576 changed between 2
and 64 rows. ``rowwise`` runs a row-wise function over tiles of TILE_ROWS rows (the last
one zero padded) under ``lax.map``: every call compiles the one [TILE_ROWS, ...] body,
whatever the step's bucket, so a row's result depends on that row alone.

The mode is set while the engine's programs are traced (``invariant``, entered by
models.quantization.native_products) and read by the model code and the sampler
(docs/batch_invariance.md).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

TILE_ROWS = 64  # rows per fixed-shape tile (products and row-wise reductions)
_INVARIANT = contextvars.ContextVar("batch_invariant", default=False)
# The data-parallel mesh whose 'data' axis splits the rows (dp > 1, tp = 1), or None.
_RANK_MESH = contextvars.ContextVar("batch_invariant_mesh", default=None)


@contextlib.contextmanager
def invariant(enabled: bool, mesh=None):
    """While tracing inside, ``active()`` is ``enabled``; ``mesh``: a data-parallel mesh
    whose 'data' axis splits every row-wise array, so that tiles are cut per rank."""
    tokens = _INVARIANT.set(enabled), _RANK_MESH.set(mesh)
    try:
        yield
    finally:
        _RANK_MESH.reset(tokens[1])
        _INVARIANT.reset(tokens[0])


def active() -> bool:
    """Whether the code being traced is in batch-invariant mode."""
    return _INVARIANT.get()


def rank_mesh(rows: int):
    """The data-parallel mesh whose ranks each take their own ``rows`` // dp rows
    (``invariant(..., mesh)``), or None (one device, or no such mesh). Rows that do not
    split evenly over the ranks are a ValueError: no rank could keep its rows' tiles."""
    mesh = _RANK_MESH.get()
    if mesh is not None and rows % mesh.shape["data"]:
        raise ValueError(f"batch-invariant row tiles under data parallelism: {rows} rows do not split over "
                         f"{mesh.shape['data']} ranks")
    return mesh


def map_rows(fn, *arrays, tile: int = TILE_ROWS):
    """fn over tiles of ``tile`` rows of every array in ``arrays`` (all the same number of
    rows on axis 0; pytree leaves alike), zero padded: fn(*tiles) -> pytree of [tile, ...]
    -> the same pytree of [rows, ...]. Each tile is one call of the same compiled body,
    traced with the mode off: a tile is one fixed shape already, so what fn calls (a
    sampler's log-softmax, say) runs on it as it comes instead of tiling it again.

    Under a data-parallel mesh (``invariant(..., mesh)``) each rank tiles its own rows
    (shard_map): left to the partitioner, a tile spanning two ranks' rows was cut in
    halves, a [32, in] product with other bits than the one device's [64, in] (float32
    on an AVX2 CPU, where the native kernel does not take the products)."""
    mesh = rank_mesh(jax.tree.leaves(arrays)[0].shape[0])
    if mesh is not None:
        local = jax.shard_map(lambda *xs: _map_rows(fn, xs, tile), mesh=mesh, in_specs=(P("data"),) * len(arrays),
                              out_specs=P("data"), check_vma=False)
        return local(*arrays)
    return _map_rows(fn, arrays, tile)


def _map_rows(fn, arrays, tile: int):
    leaves = jax.tree.leaves(arrays)
    m = leaves[0].shape[0]
    tiles = max(1, -(-m // tile))

    def split(a):
        a = jnp.pad(a, ((0, tiles * tile - m),) + ((0, 0),) * (a.ndim - 1))
        return a.reshape((tiles, tile) + a.shape[1:])

    def body(xs):
        with invariant(False):
            return fn(*xs)

    out = jax.lax.map(body, jax.tree.map(split, arrays))
    return jax.tree.map(lambda a: a.reshape((tiles * tile,) + a.shape[2:])[:m], out)


def rowwise(fn, x, tile: int = TILE_ROWS):
    """fn(x) for a function of x's last axis alone (a norm, a softmax), x [..., D]: as it
    is, or in batch-invariant mode over fixed tiles of rows (``map_rows``)."""
    if not active():
        return fn(x)
    rows = x.reshape(-1, x.shape[-1])
    return map_rows(fn, rows, tile=tile).reshape(x.shape[:-1] + (-1,))
