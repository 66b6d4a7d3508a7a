"""ModelArchConfig: the architecture facts the decoders need, read from an HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type and its parameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field")
        arch = archs[0]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        # transformers >= 5 folds rope_theta / rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        use_sw = cfg.get("use_sliding_window", True)
        return ModelArchConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=cfg.get("sliding_window") if use_sw and arch == "MistralForCausalLM" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )

    @staticmethod
    def from_pretrained(path: str | Path) -> "ModelArchConfig":
        return ModelArchConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))
