"""Turn a `model` argument into a local HF-style folder."""
from __future__ import annotations

from pathlib import Path


def resolve_model_path(model: str | None, *, progress: bool = True) -> str:
    """None -> the embedded SmolLM2 (converted from its GGUF once); a folder -> itself;
    a .gguf file -> converted into the cache; otherwise an HF hub id (needs network)."""
    if model is None:
        from models.default_model import default_model_dir

        return str(default_model_dir(progress=progress))
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} has no config.json: not an HF model folder")
        return str(p)
    if p.suffix == ".gguf" and p.is_file():
        from models.default_model import cache_root, is_current_conversion
        from models.gguf_import import convert_gguf_to_hf

        out = cache_root() / "models" / p.stem
        if not is_current_conversion(out):  # missing, or made by an older converter
            convert_gguf_to_hf(p, out, progress=progress, overwrite=out.exists())
        return str(out)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as e:  # noqa: BLE001 — any hub failure becomes one clear error
        raise ValueError(f"model {model!r} is neither a local folder nor a reachable hub id: {e}") from e
