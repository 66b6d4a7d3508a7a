"""Load HF safetensors checkpoints into the stacked [in, out] layout of models/llama.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from models.config import ModelArchConfig
from models.llama import layer_param_shapes

# Our stacked name -> (HF name inside model.layers.{i}., transpose?)
_LAYER_MAP = {
    "input_layernorm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_hf_weights(model_dir: str | Path, config: ModelArchConfig, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Returns {stacked name: array} with per-layer weights stacked on axis 0 (float32)."""
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

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r}, which {config.architecture} needs")
        used.add(name)
        return tensors[name].astype(np.float32)

    out: dict[str, np.ndarray] = {}
    out["embed_tokens"] = take("model.embed_tokens.weight")
    out["norm"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        out["lm_head"] = np.ascontiguousarray(take("lm_head.weight").T)
    for name in layer_param_shapes(config):
        hf_name, transpose = _LAYER_MAP[name]
        per_layer = []
        for i in range(config.num_hidden_layers):
            w = take(f"model.layers.{i}.{hf_name}")
            per_layer.append(w.T if transpose else w)
        out[name] = np.ascontiguousarray(np.stack(per_layer))
    # A tensor left over means the checkpoint does math this decoder would skip.
    # (Saved rotary buffers and a tied lm_head copy are harmless.)
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")
                    and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unused:
        raise ValueError(f"{model_dir}: {len(unused)} checkpoint tensor(s) that {config.architecture} as configured "
                         f"does not use, e.g. {unused[:3]}; this model variant is not supported")
    return out
