"""Gemma 3's image processor on the host (numpy and Pillow, no torch).

It follows HF's ``Gemma3ImageProcessor`` (checked against its PIL backend in
tests/e2e/test_gemma3_vl.py): resize to the tower's square (``size``; bilinear by
default), scale to [0, 1], normalize (0.5 / 0.5 on the Hub), then cut into
``patch_size`` squares in raster order, each flattened channel-major (C, P, P), as the
tower's patch convolution reads them. Every image becomes ``tokens_per_image``
placeholder tokens, whatever its size. Pan-and-scan crops are not supported.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.multimodal.qwen2_vl import ProcessedImage

# HF's PILImageResampling codes (config.json's ``resample``) -> Pillow's filters.
_RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclasses.dataclass(frozen=True)
class Gemma3ImageProcessor:
    image_size: int
    patch_size: int
    tokens_per_image: int
    resample: int = 2
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_normalize: bool = True

    @classmethod
    def from_config(cls, cfg: dict, vision) -> "Gemma3ImageProcessor":
        """From a ``preprocessor_config.json`` dict and the model's VisionConfig (its
        image side wins: the tower's position table is for that many patches)."""
        if cfg.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json: do_pan_and_scan (Gemma 3's extra crops) is not supported")
        size = cfg.get("size") or {}
        side = size.get("height", vision.image_size)
        if side != vision.image_size or size.get("width", side) != side:
            raise ValueError(f"preprocessor_config.json: size {size} does not match the tower's "
                             f"{vision.image_size} x {vision.image_size} input")
        kw = {k: cfg[k] for k in ("resample", "rescale_factor", "do_normalize") if cfg.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if cfg.get(k) is not None:
                kw[k] = tuple(cfg[k])
        return cls(vision.image_size, vision.patch_size, vision.tokens_per_image, **kw)

    @property
    def max_tokens(self) -> int:
        """Placeholder tokens of any image."""
        return self.tokens_per_image

    def __call__(self, img) -> ProcessedImage:
        """img: an RGB PIL image (jaxserve.multimodal.image.load_image)."""
        from PIL import Image

        s, p = self.image_size, self.patch_size
        if (img.width, img.height) != (s, s):
            img = img.resize((s, s), getattr(Image.Resampling, _RESAMPLE.get(self.resample, "BILINEAR")))
        x = np.asarray(img, dtype=np.float32) * np.float32(self.rescale_factor)  # [H, W, C]
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        g = s // p
        x = x.reshape(g, p, g, p, 3).transpose(0, 2, 4, 1, 3)  # [gh, gw, C, P, P]
        return ProcessedImage(np.ascontiguousarray(x.reshape(g * g, 3 * p * p), dtype=np.float32), (1, g, g),
                              self.tokens_per_image)
