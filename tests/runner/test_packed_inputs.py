"""PackedLayout: the step's small inputs in one int32 buffer and back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.sample.metadata import SamplingMetadata
from pallas_kernels.attention_metadata import AttentionMetadata


def _tree(rng):
    md = AttentionMetadata(
        slot_mapping=rng.integers(-5, 1000, (16, 2)).astype(np.int32), seq_lens=rng.integers(0, 99, 8).astype(np.int32),
        query_start_loc=np.arange(9, dtype=np.int32), block_tables=rng.integers(0, 50, (8, 2, 4)).astype(np.int32),
        num_seqs=np.array([3], np.int32))
    return (rng.standard_normal(5).astype(np.float32), md,
            np.array([0, 1, 2**32 - 1, 2**31], np.uint32), None, np.zeros((0, 3), np.int32))


def test_pack_then_unpack_in_a_program_gives_back_every_leaf_bit_for_bit():
    tree = _tree(np.random.default_rng(0))
    layout = PackedLayout.of(tree)
    buf = layout.pack(tree)
    assert buf.dtype == np.int32 and buf.shape == (layout.size,) and layout.size == 5 + 32 + 8 + 9 + 64 + 1 + 4
    out = jax.jit(layout.unpack)(jnp.asarray(buf))
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_allocate_gives_views_whose_writes_land_in_the_buffer():
    tree = _tree(np.random.default_rng(1))
    layout = PackedLayout.of(tree)
    buf, views = layout.allocate()
    assert not buf.any()
    for dst, src in zip(jax.tree.leaves(views), jax.tree.leaves(tree)):
        dst[...] = src  # in place, as the runner fills its step arrays
    np.testing.assert_array_equal(buf, layout.pack(tree))
    views[1].seq_lens[2] = 12345
    assert (buf == 12345).any()


def test_layouts_are_static_arguments():
    """Hashable and equal for equal shapes, so a jitted program keyed by one is found again."""
    a, b = PackedLayout.of(_tree(np.random.default_rng(2))), PackedLayout.of(_tree(np.random.default_rng(3)))
    assert a == b and hash(a) == hash(b)
    smd = SamplingMetadata(*(np.zeros(4, np.float32) for _ in range(14)))
    assert PackedLayout.of(smd) != PackedLayout.of((smd,))


@pytest.mark.parametrize("dtype", [np.bool_, np.float16, np.int64, np.int8])
def test_leaves_other_than_four_bytes_are_refused(dtype):
    with pytest.raises(TypeError, match="4-byte"):
        PackedLayout.of((np.zeros(3, np.int32), np.zeros(2, dtype)))
