"""A prompt's images -> its placeholder tokens and MultiModalPrompt (host, numpy).

An image stands in the prompt as one placeholder token (``<|image_pad|>`` in Qwen's
chat template); it is expanded here to the image's token count, as vLLM's prompt
update does, and each image is preprocessed with the model's own image processor.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxserve.multimodal.image import image_hash, load_image
from jaxserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt
from jaxserve.multimodal.media import MediaPolicy
from jaxserve.multimodal.qwen2_vl import Qwen2VLImageProcessor, mrope_positions

class MultiModalProcessor:
    def __init__(self, arch, image_processor, *, limit_per_prompt: int = 16,
                 max_image_tokens: int | None = None) -> None:
        self.arch = arch
        self.image_processor = image_processor
        self.image_token_id = arch.image_token_id
        self.limit_per_prompt = limit_per_prompt
        self.max_image_tokens = max_image_tokens  # the encoder budget / buffer: an image must fit

    @classmethod
    def from_model(cls, model_path, arch, **kw) -> "MultiModalProcessor | None":
        """The processor of a vision-language model's folder; None for a text model."""
        if arch.vision is None:
            return None
        path = Path(model_path) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        return cls(arch, Qwen2VLImageProcessor.from_config(cfg), **kw)

    @property
    def max_tokens_per_image(self) -> int:
        """The placeholder tokens of the largest image (max_pixels)."""
        ip = self.image_processor
        return ip.max_pixels // (ip.patch_size * ip.merge_size) ** 2

    def process(self, ids: list[int], images: list) -> tuple[list[int], MultiModalPrompt]:
        """ids (with one placeholder per image) and the images -> (the expanded ids,
        the MultiModalPrompt). ValueError naming the image for a bad one."""
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"at most {self.limit_per_prompt} images per prompt are accepted "
                             f"(--limit-mm-per-prompt), got {len(images)}")
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholder tokens (id {self.image_token_id}) "
                             f"for {len(images)} images: each image needs one")
        out, features, prev = [], [], 0
        for k, (slot, source) in enumerate(zip(slots, images)):
            try:
                if isinstance(source, str) and not source.startswith("data:"):
                    source = MediaPolicy().fetch(source)  # offline: http(s) from any host, no local files
                img = load_image(source)
                processed = self.image_processor(img)
            except ValueError as e:
                raise ValueError(f"image {k}: {e}") from None
            if self.max_image_tokens is not None and processed.num_tokens > self.max_image_tokens:
                raise ValueError(f"image {k} is {processed.num_tokens} tokens, more than the "
                                 f"{self.max_image_tokens} the encoder budget and cache hold "
                                 "(max_num_encoder_input_tokens / encoder_cache_size)")
            out += ids[prev:slot]
            features.append(MultiModalFeature(len(out), processed.num_tokens, image_hash(img),
                                              processed.pixel_values, processed.grid))
            out += [self.image_token_id] * processed.num_tokens
            prev = slot + 1
        out += ids[prev:]
        positions, delta = None, 0
        if self.arch.mrope_section:
            positions, delta = mrope_positions(len(out), [(f.offset, f.grid) for f in features],
                                               self.arch.vision.spatial_merge_size)
        return out, MultiModalPrompt(tuple(features), positions, delta)


def prompt_images(prompt) -> list | None:
    """The images of a prompt dict's ``multi_modal_data`` ({"image": one or a list}),
    None when it has none. ValueError for any other modality."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise ValueError("multi_modal_data must be a dict like {'image': <image or list of images>}")
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(unknown)}")
    images = data.get("image")
    if images is None:
        return None
    return list(images) if isinstance(images, (list, tuple)) else [images]
