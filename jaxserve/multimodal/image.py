"""Loading an image from what a request carries, and the hash that names it.

``load_image`` accepts what vLLM's chat parts and ``multi_modal_data`` accept: a PIL
image, an ``[H, W, 3]`` / ``[H, W]`` uint8 (or float in [0, 1]) array, raw PNG / JPEG /
WebP bytes, or a ``data:image/...;base64,`` URL. Every failure is a ValueError that
says what was wrong, so the server can answer 400.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io

import numpy as np

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decoded image above this is refused (decompression bombs)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decode_data_url(url: str) -> bytes:
    """``data:image/png;base64,...`` -> the image's bytes."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError("an image data URL must look like 'data:image/<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the image data URL's base64 payload does not decode: {e}") from None


def load_image(source):
    """source -> an RGB PIL image (see the module docstring for what source may be)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, np.ndarray):
        arr = source
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, axis=-1)
        if arr.ndim != 3 or arr.shape[-1] not in (3, 4):
            raise ValueError(f"an image array must be [H, W], [H, W, 3] or [H, W, 4], not {list(source.shape)}")
        if arr.dtype != np.uint8:
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"an image array must be uint8 or float in [0, 1], not {arr.dtype}")
            arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        img = Image.fromarray(np.ascontiguousarray(arr))
    else:
        if isinstance(source, str):
            source = decode_data_url(source)
        if not isinstance(source, (bytes, bytearray, memoryview)):
            raise ValueError(f"an image must be a PIL image, a numpy array, bytes or a data URL, "
                             f"not {type(source).__name__}")
        try:
            img = Image.open(io.BytesIO(bytes(source)), formats=IMAGE_FORMATS)
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"the image is {img.width}x{img.height} pixels; at most {MAX_IMAGE_PIXELS} "
                                 "are accepted")
            img.load()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise ValueError(f"the image could not be decoded ({', '.join(IMAGE_FORMATS)} are read): {e}") from None
    if img.width < 1 or img.height < 1:
        raise ValueError("the image is empty")
    if img.width * img.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {img.width}x{img.height} pixels; at most {MAX_IMAGE_PIXELS} are accepted")
    return img if img.mode == "RGB" else img.convert("RGB")


def image_hash(img) -> str:
    """The hex sha256 of an RGB image's size and pixels: the same picture sent twice (as
    PNG or as JPEG decoded to the same pixels, or as an array) gets one hash. The
    encoder-output cache and the prefix cache's block hashes key on it."""
    h = hashlib.sha256(f"{img.width}x{img.height}:".encode())
    h.update(np.asarray(img, dtype=np.uint8).tobytes())
    return h.hexdigest()
