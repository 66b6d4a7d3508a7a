"""Load HF safetensors checkpoints by a model class's weight map (models/base.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from models.config import ModelArchConfig
from models.registry import get_model_class


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_hf_weights(model_dir: str | Path, config: ModelArchConfig, model_cls=None, *,
                    progress: bool = True) -> dict[str, np.ndarray]:
    """Returns {our name: float32 array} for every entry of the model class's
    ``weight_map`` (default: the class of ``config.architecture``), transposed where the
    map says so; per-layer tensors ("{i}" in the name) are stacked on axis 0."""
    model_cls = model_cls or get_model_class(config.architecture)
    weight_map = model_cls.weight_map(config)
    ignored = re.compile("|".join(f"(?:{r})" for r in model_cls.ignored_hf_tensors(config)) or "(?!)")
    model_dir = Path(model_dir)
    tensors: dict[str, np.ndarray] = {}
    files = _safetensors_files(model_dir)
    for f in tqdm(files, desc="Loading safetensors", disable=not progress or len(files) < 2):
        # framework="np" keeps torch out of the runtime; bf16 checkpoints come back as
        # ml_dtypes bfloat16 arrays.
        with safe_open(str(f), framework="np") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    used = set()

    def take(name: str, transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r}, which {config.architecture} needs")
        used.add(name)
        w = tensors[name].astype(np.float32)
        return w.T if transpose else w

    out: dict[str, np.ndarray] = {}
    for name, w in weight_map.items():
        if w.per_layer:
            value = np.stack([take(w.hf_name.format(i=i), w.transpose) for i in range(config.num_hidden_layers)])
        else:
            value = take(w.hf_name, w.transpose)
        out[name] = np.ascontiguousarray(value)
    # A tensor left over means the checkpoint does math this decoder would skip
    # (the model lists the harmless ones: saved rotary buffers, a tied lm_head copy).
    unused = sorted(n for n in tensors if n not in used and not ignored.fullmatch(n))
    if unused:
        raise ValueError(f"{model_dir}: {len(unused)} checkpoint tensor(s) that {config.architecture} as configured "
                         f"does not use, e.g. {unused[:3]}; this model variant is not supported")
    return out
