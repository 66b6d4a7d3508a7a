"""KV cache groups: layers whose pages share one block table (vLLM's hybrid KV cache).

A model whose layers all attend alike has one group: a block id names a page in every
layer. Gemma's interleaved local (sliding-window) and global layers need two kinds of
block tables: a local layer can give back the pages behind its window, a global layer
keeps the whole context. So layers are split into groups of ``slots_per_block`` layers
each, every group of one kind, and a block id names ``slots_per_block`` layers' pages
(one per slot). All groups draw blocks from one pool: a block is equally useful to any
group. A request holds one block list per group, all of the same length (position i
of each covers tokens [i*S, (i+1)*S)); a sliding group's list holds the null block
where its pages were given back.

The device cache is [slots_per_block, P, S, 2K, H]; layer l reads slot
``layer_slot[l]`` with the block table of group ``layer_group[l]``.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.kv_cache_utils import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (model layer indices, at most slots_per_block) and the
    window they attend to (None: the whole context)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroupSpec, ...]
    slots_per_block: int  # layers' pages one block id names

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Model layer -> its group."""
        return self._layer_table()[0]

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Model layer -> its slot (index on the cache's first axis)."""
        return self._layer_table()[1]

    def _layer_table(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = sum(len(g.layers) for g in self.groups)
        group, slot = [0] * n, [0] * n
        for gi, g in enumerate(self.groups):
            for si, layer in enumerate(g.layers):
                group[layer], slot[layer] = gi, si
        return tuple(group), tuple(slot)

    def blocks_held(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` KV slots holds at once: every
        full group holds its whole context; a sliding group its window plus one step's
        chunk (written before the blocks behind the window go back) and two partial blocks."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for g in self.groups:
            if g.sliding_window is None:
                total += full
            else:
                total += min(full, cdiv(g.sliding_window + max_num_batched_tokens, block_size) + 2)
        return total


def make_kv_cache_layout(num_layers: int, sliding_window: int | None = None,
                         sliding_window_layers: tuple[bool, ...] | None = None) -> KVCacheLayout:
    """Groups for a model of ``num_layers`` layers. ``sliding_window_layers``: which layers
    slide (None: all of them, when ``sliding_window`` is set).

    Uniform models get one group of every layer. Mixed models (Gemma 2: half the layers
    local; Gemma 3: five in six) get groups as large as the smaller kind's layer count,
    so the smaller kind is one group and the other kind is split into as many groups as
    it takes; a last, short group leaves some slots unused (vLLM pads the same way).
    """
    if sliding_window is None:
        return KVCacheLayout((KVCacheGroupSpec(tuple(range(num_layers))),), num_layers)
    kinds = sliding_window_layers if sliding_window_layers is not None else (True,) * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"sliding_window_layers has {len(kinds)} entries for {num_layers} layers")
    local = tuple(i for i, s in enumerate(kinds) if s)
    full = tuple(i for i, s in enumerate(kinds) if not s)
    if not full or not local:
        window = sliding_window if local else None
        return KVCacheLayout((KVCacheGroupSpec(tuple(range(num_layers)), window),), num_layers)
    size = min(len(full), len(local))
    groups = [KVCacheGroupSpec(full[i:i + size]) for i in range(0, len(full), size)]
    groups += [KVCacheGroupSpec(local[i:i + size], sliding_window) for i in range(0, len(local), size)]
    return KVCacheLayout(tuple(groups), size)
