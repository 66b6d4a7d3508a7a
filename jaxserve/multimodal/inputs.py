"""What a request carries for its images (numpy only: the scheduler in jaxserve/core reads it)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image of a prompt (vLLM's MultiModalFeatureSpec): its placeholder tokens
    ``[offset, offset + length)`` in the prompt, which the vision tower's ``length``
    outputs replace; ``mm_hash`` names the picture (jaxserve.multimodal.image.image_hash)
    for the encoder-output cache and the prefix cache."""
    offset: int
    length: int
    mm_hash: str
    pixel_values: np.ndarray  # [patches, patch_dim] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalPrompt:
    """A prompt's images, in prompt order, and its M-RoPE positions ([3, prompt_len]
    int32; generated token i sits at i + mrope_delta), None for a model without M-RoPE."""
    features: tuple[MultiModalFeature, ...]
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
