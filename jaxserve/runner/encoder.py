"""The vision tower's program and the encoder-output buffer (docs/design.md §13).

The scheduler picks which images to encode each step and their rows of the buffer
(jaxserve/core/encoder_cache_manager.py); before the step's model step the runner
runs the tower over them in one program, whose input is the images' patches laid out
window by window (jaxserve.multimodal.qwen2_vl.vision_layout) padded to a power-of-two
count of windows (Gemma 3's fixed-size images: a power-of-two count of images; one
EncoderKey program each, compiled in the warm-up's first stage up to what one step's
encoder budget holds), and which writes each image token's embedding into its row (the
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

        def encode(state, tower_inputs, dest, buffer, *, window_len):
            """tower_inputs: the model's encode_images arguments (``_tower_inputs``);
            dest [outputs]: each output's buffer row (past the end: dropped) -> the buffer."""
            model = nnx.merge(graphdef, state)
            out = model.encode_images(*tower_inputs, **({"window_len": window_len} if window_len else {}))
            return buffer.at[dest].set(out.astype(buffer.dtype), mode="drop")

        self.jitted = jax.jit(encode, donate_argnums=(3,), static_argnames=("window_len",))
        budget = runner.config.scheduler_config.encoder_budget
        if self.vc.kind == "siglip":
            # Gemma 3: every image is one fixed square; a program per power-of-two image
            # count, up to the images one step's encoder budget holds.
            self.window_len = 0
            top = window_bucket(max(budget // self.vc.tokens_per_image, 1))
        else:
            merge = self.vc.spatial_merge_size
            self.window_len = self.vc.window_merged ** 2 * merge ** 2
            # Warmed up: every window count up to a step's worst single image, a strip one
            # merged token high of the whole encoder budget (cdiv(budget, window side)
            # windows); a step past it compiles on first use, logged.
            top = window_bucket(-(-budget // self.vc.window_merged))
        self.buckets = [1 << i for i in range(top.bit_length())]

    def keys(self) -> list[EncoderKey]:
        """The warm-up's tower programs."""
        return [EncoderKey(n, self.window_len) for n in self.buckets]

    def abstract_inputs(self, key: EncoderKey) -> tuple:
        """The types of a tower program's inputs after the params."""
        s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)  # noqa: E731
        vc = self.vc
        if vc.kind == "siglip":
            n = (vc.image_size // vc.patch_size) ** 2
            tower = (s((key.num_windows, n, vc.patch_dim), jnp.float32),)
            outputs = key.num_windows * vc.tokens_per_image
        else:
            m = key.num_windows * key.window_len
            tower = (s((m, vc.patch_dim), jnp.float32), s((m,), jnp.int32), s((m, 2), jnp.int32))
            outputs = m // vc.spatial_merge_size ** 2
        return tower, s((outputs,), jnp.int32), s(self.buffer.shape, self.buffer.dtype)

    def _tower_inputs(self, items) -> tuple[int, tuple, np.ndarray]:
        """(bucket, the tower's inputs, each output's buffer row) for ``items``
        [(MultiModalFeature, rows)]."""
        vc = self.vc
        rows = np.concatenate([np.asarray(r, np.int32) for _, r in items])
        if vc.kind == "siglip":
            bucket = window_bucket(len(items))
            px = np.zeros((bucket,) + items[0][0].pixel_values.shape, np.float32)
            px[:len(items)] = np.stack([f.pixel_values for f, _ in items])
            dest = np.full(bucket * vc.tokens_per_image, self.capacity, np.int32)
            dest[:len(rows)] = rows
            return bucket, (px,), dest
        merge = vc.spatial_merge_size
        grids = [f.grid for f, _ in items]
        bucket = window_bucket(sum(num_windows(g, merge, vc.window_merged) for g in grids))
        lay = vision_layout(grids, merge, vc.window_merged, pad_windows_to=bucket)
        pixels = np.concatenate([f.pixel_values for f, _ in items])
        px = np.where((lay.patch_index >= 0)[:, None], pixels[np.maximum(lay.patch_index, 0)], 0.0)
        dest = np.full(len(lay.patch_index) // merge ** 2, self.capacity, np.int32)
        dest[lay.out_index] = rows
        return bucket, (px.astype(np.float32), lay.image_id, lay.pos_hw), dest

    def run(self, encodes: dict) -> None:
        """Encode ``encodes`` (mm_hash -> (MultiModalFeature, rows)) into the buffer."""
        if not encodes:
            return
        items = list(encodes.values())
        bucket, tower, dest = self._tower_inputs(items)
        key = EncoderKey(bucket, self.window_len)
        if key not in self.runner.compilation.executables:
            logger.info("compiling the vision tower for a bucket of %d (%d images): past the warm-up's", bucket,
                        len(items))
        put = lambda x: jax.device_put(x, self.sharding)  # noqa: E731
        self.buffer = self.runner._run(key, self.runner.state, tuple(put(x) for x in tower), put(dest),
                                       self.buffer)
        self.num_encoded += len(items)
