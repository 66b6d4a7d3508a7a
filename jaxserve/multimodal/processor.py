"""A prompt's images -> its placeholder tokens and MultiModalPrompt (host, numpy).

An image stands in the prompt as one placeholder token, which is expanded here to the
image's tokens, as vLLM's prompt update does, and each image is preprocessed with the
model's own image processor:

- Qwen2.5-VL: ``<|image_pad|>`` (inside the chat template's vision start / end) becomes
  that many ``<|image_pad|>`` as the image has merged patches.
- Gemma 3: ``<start_of_image>`` becomes HF's full image sequence, "\n\n" +
  ``<start_of_image>`` + ``tokens_per_image`` x ``<image_soft_token>`` +
  ``<end_of_image>`` + "\n\n" (the newlines as the tokenizer spells them).
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
                 max_image_tokens: int | None = None, tokenizer=None) -> None:
        self.arch = arch
        self.image_processor = image_processor
        self.image_token_id = arch.image_token_id
        vc = arch.vision
        # The token the chat template writes per image, and what it expands to around the
        # image's tokens: (ids before, ids after).
        self.placeholder_id = self.image_token_id
        self.wrap = ([], [])
        if vc.kind == "siglip":
            if vc.boi_token_id is None or vc.eoi_token_id is None:
                raise ValueError("config.json: Gemma 3 needs boi_token_index and eoi_token_index")
            self.placeholder_id = vc.boi_token_id
            newlines = [] if tokenizer is None else tokenizer.encode("\n\n", add_special_tokens=False)
            self.wrap = (newlines + [vc.boi_token_id], [vc.eoi_token_id] + newlines)
        self.limit_per_prompt = limit_per_prompt
        self.max_image_tokens = max_image_tokens  # the encoder budget / buffer: an image must fit

    @classmethod
    def from_model(cls, model_path, arch, tokenizer=None, **kw) -> "MultiModalProcessor | None":
        """The processor of a vision-language model's folder; None for a text model.
        ``tokenizer`` spells Gemma 3's newlines around an image (None: left out, as for
        counting tokens)."""
        if arch.vision is None:
            return None
        path = Path(model_path) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        if arch.vision.kind == "siglip":
            from jaxserve.multimodal.gemma3 import Gemma3ImageProcessor

            return cls(arch, Gemma3ImageProcessor.from_config(cfg, arch.vision), tokenizer=tokenizer, **kw)
        return cls(arch, Qwen2VLImageProcessor.from_config(cfg), **kw)

    @property
    def max_tokens_per_image(self) -> int:
        """The placeholder tokens of the largest image."""
        return self.image_processor.max_tokens

    def process(self, ids: list[int], images: list) -> tuple[list[int], MultiModalPrompt]:
        """ids (with one placeholder per image) and the images -> (the expanded ids,
        the MultiModalPrompt). ValueError naming the image for a bad one."""
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"at most {self.limit_per_prompt} images per prompt are accepted "
                             f"(--limit-mm-per-prompt), got {len(images)}")
        slots = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholder tokens (id {self.placeholder_id}) "
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
            out += ids[prev:slot] + self.wrap[0]
            features.append(MultiModalFeature(len(out), processed.num_tokens, image_hash(img),
                                              processed.pixel_values, processed.grid))
            out += [self.image_token_id] * processed.num_tokens + self.wrap[1]
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
