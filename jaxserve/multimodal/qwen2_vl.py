"""Qwen2-VL / Qwen2.5-VL on the host: the image processor and the 3D (M-RoPE) positions.

The processor follows HF's ``Qwen2VLImageProcessor`` (checked against it in
tests/multimodal/test_qwen2_vl_processor.py): resize so that both sides are multiples
of ``patch_size * merge_size`` with the pixel count in ``[min_pixels, max_pixels]``
(bicubic), scale to [0, 1], normalize, then cut into ``patch_size`` squares ordered
merge-block by merge-block (the 2x2 patches that the tower's merger fuses into one
token are consecutive), each repeated ``temporal_patch_size`` times (a still image is a
video of identical frames). An image of ``h x w`` patches becomes ``h*w/merge**2``
placeholder tokens in the prompt.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``factor``, the aspect
    ratio kept as near as rounding allows, the area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower.

    pixel_values: [N, C * T * P * P] float32 (N = grid_h * grid_w patches);
    grid: (1, grid_h, grid_w) in patches; num_tokens: its placeholder tokens."""
    pixel_values: np.ndarray
    grid: tuple[int, int, int]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = OPENAI_CLIP_MEAN
    image_std: tuple = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, cfg: dict) -> "Qwen2VLImageProcessor":
        """From a ``preprocessor_config.json`` dict (its ``size`` or its older
        ``min_pixels`` / ``max_pixels``)."""
        size = cfg.get("size") or {}
        kw = {k: cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor") if k in cfg}
        kw["min_pixels"] = cfg.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        kw["max_pixels"] = cfg.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        for k in ("image_mean", "image_std"):
            if k in cfg:
                kw[k] = tuple(cfg[k])
        return cls(**kw)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    @property
    def max_tokens(self) -> int:
        """Placeholder tokens of the largest image (max_pixels)."""
        return self.max_pixels // (self.patch_size * self.merge_size) ** 2

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of height x width pixels."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def __call__(self, img) -> ProcessedImage:
        """img: an RGB PIL image (jaxserve.multimodal.image.load_image)."""
        from PIL import Image

        h, w = self.target_size(img.height, img.width)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), Image.Resampling.BICUBIC)
        x = np.asarray(img, dtype=np.float32) * np.float32(self.rescale_factor)  # [H, W, C]
        x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t, p, p))
        return ProcessedImage(np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p), dtype=np.float32),
                              (1, gh, gw), gh * gw // m ** 2)


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge_size: int):
    """The 3D positions of a prompt (HF's ``get_rope_index`` for images).

    images: (offset of the image's first placeholder token, grid (t, h, w) in patches),
    in prompt order. Text counts on from the previous item on all three axes; an image's
    tokens sit at (start, start + row, start + column) of its merged grid, and the text
    after it starts at start + max(rows, columns). Returns (positions [3, num_tokens]
    int32, delta): a token generated at index i sits at i + delta on all three axes."""
    pos = np.empty((3, num_tokens), np.int64)
    cur = idx = 0
    for offset, (t, gh, gw) in images:
        n_text = offset - idx
        pos[:, idx:offset] = cur + np.arange(n_text)
        cur += n_text
        lh, lw = gh // merge_size, gw // merge_size
        n = t * lh * lw
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        pos[:, offset:offset + n] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(lh, lw)
        idx = offset + n
    pos[:, idx:] = cur + np.arange(num_tokens - idx)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos.astype(np.int32), delta


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Where each patch of a batch of images sits in the vision tower's input.

    The tower attends within windows of ``window_merged``-square merged tokens in most
    blocks and over the whole image in a few; its input is laid out window by window,
    each window padded to ``window_len`` patches (``window_merged**2 * merge**2``), so
    that a windowed block is one dense attention per row of ``[windows, window_len]``
    (HF reorders the patches into windows the same way: ``get_vision_window_index``).
    A merge block's patches stay consecutive, so the merger's groups of ``merge**2``
    rows never straddle a window.

    patch_index [M]: the row of the images' concatenated ``pixel_values`` in each slot
    (-1: padding); image_id [M] (-1: padding); pos_hw [M, 2]: the patch's (row,
    column) in its image, for the tower's 2D rotary; out_index [sum of tokens]: the
    merged row (of the tower's [M / merge**2] outputs) of each image token, image
    after image, in prompt order."""
    patch_index: np.ndarray
    image_id: np.ndarray
    pos_hw: np.ndarray
    out_index: np.ndarray
    window_len: int

    @property
    def num_windows(self) -> int:
        return len(self.patch_index) // self.window_len


def vision_layout(grids: list[tuple[int, int, int]], merge: int, window_merged: int,
                  pad_windows_to: int | None = None) -> VisionLayout:
    """The layout of ``grids`` (each (1, h, w) in patches). ``pad_windows_to``: the
    window count to pad to (a compiled bucket; None: exactly as many as needed)."""
    unit = merge * merge
    wlen = window_merged * window_merged * unit
    patch_index, image_id, pos, out_index = [], [], [], []
    base = 0  # the image's first row in pixel_values
    slot = 0
    for img, (t, gh, gw) in enumerate(grids):
        if t != 1:
            raise ValueError("only still images (one temporal patch) are supported")
        lh, lw = gh // merge, gw // merge
        merged_row = np.empty((lh, lw), np.int64)  # each merged token's output row
        for wi in range(0, lh, window_merged):
            for wj in range(0, lw, window_merged):
                n = 0
                for ui in range(wi, min(wi + window_merged, lh)):
                    for uj in range(wj, min(wj + window_merged, lw)):
                        merged_row[ui, uj] = (slot + n) // unit
                        u = ui * lw + uj
                        for k in range(unit):
                            patch_index.append(base + u * unit + k)
                            pos.append((ui * merge + k // merge, uj * merge + k % merge))
                        n += unit
                patch_index.extend([-1] * (wlen - n))
                pos.extend([(0, 0)] * (wlen - n))
                image_id.extend([img] * n + [-1] * (wlen - n))
                slot += wlen
        out_index.append(merged_row.ravel())
        base += gh * gw
    nw = slot // wlen
    if pad_windows_to is not None:
        if pad_windows_to < nw:
            raise ValueError(f"{nw} windows do not fit a bucket of {pad_windows_to}")
        extra = (pad_windows_to - nw) * wlen
        patch_index.extend([-1] * extra)
        pos.extend([(0, 0)] * extra)
        image_id.extend([-1] * extra)
    return VisionLayout(np.asarray(patch_index, np.int32), np.asarray(image_id, np.int32),
                        np.asarray(pos, np.int32).reshape(-1, 2),
                        np.concatenate(out_index).astype(np.int32) if out_index else np.zeros(0, np.int32), wlen)


def num_windows(grid: tuple[int, int, int], merge: int, window_merged: int) -> int:
    """Windows of one image of ``grid`` patches."""
    _, gh, gw = grid
    return -(-(gh // merge) // window_merged) * -(-(gw // merge) // window_merged)
