"""A chat message's content parts -> what the chat template sees, and its images.

Shared by LLM.chat and the server: text parts (OpenAI's ``text`` / ``input_text``),
image parts (``image_url`` with a URL, ``input_image``, or offline ``image`` with a PIL
image / array / bytes). In a message with images the template gets the parts as a list
with ``{"type": "image"}`` where each image was (the model's template writes its
placeholder there); a text-only message gets its texts joined by newlines.
"""
from __future__ import annotations


def split_content(content: list, where: str, images: list | None):
    """content parts -> the template's content; each image's (where, source) is
    appended to ``images`` (None: the model takes text only, and an image part is a
    ValueError)."""
    texts, parts = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: a content part must be an object")
        kind = part.get("type")
        if kind in ("text", "input_text", None) and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "input_image", "image"):
            if images is None:
                raise ValueError(f"{at}: this model takes text only; image parts need a vision-language model")
            source = part.get("image_url") if kind != "image" else part.get("image")
            if kind == "input_image" and source is None:
                source = part.get("image_url")
            if isinstance(source, dict):
                source = source.get("url")
            if source is None or (isinstance(source, str) and not source):
                raise ValueError(f"{at}: an image part needs image_url.url (a data: or http(s) URL)")
            images.append((at, source))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"{at}: content part of type {kind!r} is not supported (text and image_url are)")
    return parts if any(p["type"] == "image" for p in parts) else "\n".join(texts)
