"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes it) into the
host arrays of one device slot (models/lora.py), checked against the served model.

PEFT stores, per targeted module, ``lora_A.weight`` [r, in] and ``lora_B.weight``
[out, r], and the update is ``scale * B @ A`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` / ``alpha_pattern``
override them per module). A slot holds ``a = A^T`` [L, in, R] and
``b = scale * B^T`` [L, R, out] for every target projection, zero where the adapter
has no such module or a smaller rank than R (zeros add nothing), with B's columns laid
out as the served projection's (KV heads replicated under tensor parallelism).

What vLLM refuses is refused here, with its words where it has them: DoRA, LoRA biases,
``modules_to_save``, a rank above ``max_lora_rank``, a module the model cannot adapt
(embeddings, lm_head, MoE experts), and tensors of another model's shapes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from jaxserve.lora.request import LoRARequest
from models.base import dim_size
from models.config import ModelArchConfig
from models.lora import LoRATarget
from models.sharding import checkpoint_arch
from models.weights import SafetensorsCheckpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter's
# name when saving; a ".default" left in is accepted).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAAdapterNotFoundError(ValueError):
    """The adapter's folder or its files are missing (vLLM's message). A ValueError:
    a request naming it is refused like any bad input."""

    def __init__(self, lora: LoRARequest) -> None:
        super().__init__(f"Loading lora {lora.lora_name} failed: No adapter found for {lora.lora_path}")


@dataclasses.dataclass
class HostAdapter:
    """One adapter's slot contents on the host."""

    lora: LoRARequest
    rank: int  # the largest rank among its modules
    modules: tuple[str, ...]  # the target projections it changes
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # projection -> (a [L, in, R], b [L, R, out]) float32

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the
    module path's end (``(.*\\.)?key$``), else ``default``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def read_adapter_config(lora: LoRARequest, max_lora_rank: int) -> dict:
    """The adapter's adapter_config.json, checked (ValueError listing every problem)."""
    folder = Path(lora.lora_path).expanduser()
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise LoRAAdapterNotFoundError(lora)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: {path} must hold a JSON object")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: Missing required configuration fields: {missing}")
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg['peft_type']!r} is not supported (LORA only).")
    r = cfg["r"]
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"LoRA rank `r` must be a positive integer, got {r}.")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save is not supported (the adapter replaces whole modules): "
                        f"{cfg['modules_to_save']}.")
    if cfg.get("use_dora"):
        problems.append("DoRA is not supported.")
    if cfg.get("lora_bias"):
        problems.append("LoRA bias (lora_bias) is not supported.")
    if cfg.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    ranks = [r] + list((cfg.get("rank_pattern") or {}).values())
    if all(isinstance(x, int) for x in ranks) and max(ranks) > max_lora_rank:
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}.")
    if problems:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: " + " ".join(problems))
    return cfg


def check_target_modules(lora: LoRARequest, cfg: dict, targets: dict[str, LoRATarget]) -> None:
    """target_modules names only projections the model can adapt (a list of module
    names or paths, PEFT's "all-linear", or a regex matched against module paths)."""
    tm = cfg["target_modules"]
    if isinstance(tm, str):
        return  # "all-linear" or a regex: the tensors themselves are checked
    supported = {t.module.rsplit(".", 1)[-1] for t in targets.values()}
    unknown = sorted({m for m in tm if m.rsplit(".", 1)[-1] not in supported})
    if unknown:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: target_modules {unknown} are not supported; "
                         f"this model adapts {sorted(supported)}")


def read_adapter(lora: LoRARequest, model_cls, arch: ModelArchConfig, targets: dict[str, LoRATarget], *,
                 max_lora_rank: int) -> HostAdapter:
    """The adapter at ``lora.lora_path`` as one slot's host arrays (see the module
    docstring). ``arch``: the served architecture (tensor-parallel KV replicas
    included); ``targets``: models.lora.lora_targets of the model."""
    cfg = read_adapter_config(lora, max_lora_rank)
    check_target_modules(lora, cfg, targets)
    folder = Path(lora.lora_path).expanduser()
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: adapter_model.bin (a PyTorch pickle) is not read; "
                             "save the adapter with safetensors (PEFT's default)")
        raise LoRAAdapterNotFoundError(lora)
    try:  # the checkpoint reader: bf16 tensors too (numpy has no bfloat16 of its own)
        ckpt_file = SafetensorsCheckpoint(folder)
        tensors = {name: ckpt_file.read(name, tuple(slice(None) for _ in info.shape))
                   for name, info in ckpt_file.tensors.items()}
    except (OSError, ValueError, KeyError, struct.error) as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: cannot read {path}: {e}") from e
    if not tensors:
        raise ValueError(f"{folder} doesn't contain tensors")
    by_module: dict[str, list[LoRATarget]] = {}  # a fused module (Phi-3's qkv_proj) serves several
    for t in targets.values():
        by_module.setdefault(t.module, []).append(t)
    ckpt = checkpoint_arch(arch)
    layers = arch.num_hidden_layers
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    unexpected = set()
    for key, value in tensors.items():
        m = _TENSOR.match(key)
        if m is None or m.group(2) not in by_module or int(m.group(1)) >= layers:
            unexpected.add(key if m is None else m.group(2))
            continue
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    if unexpected:
        raise ValueError(f"While loading {folder}, expected target modules in {sorted(by_module)} (layers 0.."
                         f"{layers - 1}) but received {sorted(unexpected)}. Please verify that the loaded LoRA "
                         "module is correct")
    rank_pad = max_lora_rank
    weights = {n: (np.zeros((layers, dim_size(arch, t.in_dim), rank_pad), np.float32),
                   np.zeros((layers, rank_pad, dim_size(arch, t.out_dim)), np.float32)) for n, t in targets.items()}
    use_rslora = bool(cfg.get("use_rslora", False))
    max_rank, modules = 0, set()
    for (layer, module), ab in sorted(found.items()):
        first = by_module[module][0]  # a fused module's blocks share its in dim and fused rows
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        d_in = dim_size(ckpt, first.in_dim)
        d_out = dim_size(ckpt, first.fused_rows if first.fused_rows else first.out_dim)
        r = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise ValueError(f"LoRA adapter {lora.lora_name!r} does not fit this model: layer {layer} {module} has "
                             f"lora_A {list(a.shape)} and lora_B {list(b.shape)}, the model needs [r, {d_in}] and "
                             f"[{d_out}, r] (an adapter of another base model?)")
        if r > max_lora_rank:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: LoRA rank {r} is greater than max_lora_rank "
                             f"{max_lora_rank}.")
        if not (np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)):
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: layer {layer} {module} is not a float tensor")
        path_name = f"model.layers.{layer}.{module}"
        alpha = _pattern_value(cfg.get("alpha_pattern"), path_name, cfg["lora_alpha"])
        scale = alpha / (math.sqrt(r) if use_rslora else r)
        for t in by_module[module]:  # each block of a fused module takes its rows of B
            off = dim_size(ckpt, t.row_offset) if t.row_offset else 0
            rows = b[off:off + dim_size(ckpt, t.out_dim)]
            wa, wb = weights[t.name]
            wa[layer, :, :r] = a.astype(np.float32).T
            wb[layer, :r, :] = (scale * rows.astype(np.float32)).T[:, t.out_source(arch)]
            modules.add(t.name)
        max_rank = max(max_rank, r)
    return HostAdapter(lora, max_rank, tuple(sorted(modules)), weights)
