"""AttentionMetadata: per-step device inputs of the attention layers (one pytree).

It lives with the kernels, below the models: the attention backend (backend.py) takes
it, and the models and the runner pass it through."""
from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """With data parallelism every array is the DP ranks' own arrays concatenated on
    axis 0 (split over the mesh's 'data' axis): each rank's page ids and offsets are
    local to its own slice of the KV cache. Shapes below are one rank's."""

    # G: the KV cache groups (jaxserve/core/kv_cache_groups.py; 1 unless the model mixes
    # sliding-window and global layers), each with its own pages.
    slot_mapping: jax.Array  # [T, G] int32: page * S + offset of each token's KV slot
    seq_lens: jax.Array  # [Rmax] int32: kv_lens (computed + scheduled tokens)
    query_start_loc: jax.Array  # [Rmax+1] int32: cu_q_lens
    block_tables: jax.Array  # [Rmax, G, Pmax] int32: page indices per request
    num_seqs: jax.Array  # [1] int32: valid rows of the per-request arrays
    # [T] int32 or None: how many keys past its own position each token also attends to
    # (Gemma 3: an image token sees the rest of its image, all in this step). None: causal.
    keys_ahead: jax.Array | None = None
