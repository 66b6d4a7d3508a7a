"""The vision tower's program and the encoder-output buffer (docs/design.md §13).

The scheduler picks which images to encode each step and their rows of the buffer
(jaxserve/core/encoder_cache_manager.py); before the step's model step the runner
runs the tower over them in one program, whose input is the images' patches laid out
window by window (jaxserve.multimodal.qwen2_vl.vision_layout) padded to a power-of-two
count of windows (one EncoderKey program each, compiled in the warm-up's first stage
up to the largest image's count), and which writes each image token's embedding into its row (the
buffer is donated and replaced). The model step then reads each placeholder token's
row. Encodes are counted (``num_encoded``): an image that several requests send is
encoded once while its rows are kept.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.multimodal.qwen2_vl import num_windows, vision_layout
from jaxserve.runner.program_key import EncoderKey

logger = logging.getLogger(__name__)


def window_bucket(n: int) -> int:
    """The compiled window count for n windows: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


class EncoderRunner:
    def __init__(self, runner, capacity: int) -> None:
        self.runner = runner
        self.vc = runner.arch.vision
        self.capacity = capacity
        self.sharding = runner._replicated
        self.buffer = jax.device_put(jnp.zeros((capacity, runner.arch.hidden_size), runner.dtype), self.sharding)
        self.num_encoded = 0
        graphdef = runner.graphdef

        def encode(state, pixels, image_id, pos_hw, dest, buffer, *, window_len):
            """pixels [M, patch_dim], image_id [M], pos_hw [M, 2], dest [M / merge**2]
            (each merged output's buffer row; past the end: dropped) -> the buffer."""
            out = nnx.merge(graphdef, state).encode_images(pixels, image_id, pos_hw, window_len)
            return buffer.at[dest].set(out.astype(buffer.dtype), mode="drop")

        self.jitted = jax.jit(encode, donate_argnums=(5,), static_argnames=("window_len",))
        merge = self.vc.spatial_merge_size
        self.window_len = self.vc.window_merged ** 2 * merge ** 2
        # Warmed up: every window count up to a step's worst single image, a strip one
        # merged token high of the whole encoder budget (cdiv(budget, window side)
        # windows); a step past it compiles on first use, logged.
        budget = runner.config.scheduler_config.encoder_budget
        top = window_bucket(-(-budget // self.vc.window_merged))
        self.buckets = [1 << i for i in range(top.bit_length())]

    def keys(self) -> list[EncoderKey]:
        """The warm-up's tower programs."""
        return [EncoderKey(n, self.window_len) for n in self.buckets]

    def abstract_inputs(self, key: EncoderKey) -> tuple:
        """The types of a tower program's inputs after the params."""
        m = key.num_windows * key.window_len
        s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)  # noqa: E731
        return (s((m, self.vc.patch_dim), jnp.float32), s((m,), jnp.int32), s((m, 2), jnp.int32),
                s((m // self.vc.spatial_merge_size ** 2,), jnp.int32),
                s(self.buffer.shape, self.buffer.dtype))

    def run(self, encodes: dict) -> None:
        """Encode ``encodes`` (mm_hash -> (MultiModalFeature, rows)) into the buffer."""
        if not encodes:
            return
        vc, merge = self.vc, self.vc.spatial_merge_size
        items = list(encodes.values())
        grids = [f.grid for f, _ in items]
        need = sum(num_windows(g, merge, vc.window_merged) for g in grids)
        bucket = window_bucket(need)
        lay = vision_layout(grids, merge, vc.window_merged, pad_windows_to=bucket)
        pixels = np.concatenate([f.pixel_values for f, _ in items])
        px = np.where((lay.patch_index >= 0)[:, None], pixels[np.maximum(lay.patch_index, 0)], 0.0)
        dest = np.full(len(lay.patch_index) // merge ** 2, self.capacity, np.int32)
        dest[lay.out_index] = np.concatenate([np.asarray(rows, np.int32) for _, rows in items])
        key = EncoderKey(bucket, lay.window_len)
        if key not in self.runner.compilation.executables:
            logger.info("compiling the vision tower for %d windows (%d patches): past the warm-up's", bucket,
                        len(lay.patch_index))
        put = lambda x: jax.device_put(x, self.sharding)  # noqa: E731
        self.buffer = self.runner._run(key, self.runner.state, put(px.astype(np.float32)), put(lay.image_id),
                                       put(lay.pos_hw), put(dest), self.buffer)
        self.num_encoded += len(items)
