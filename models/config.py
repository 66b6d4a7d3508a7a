"""ModelArchConfig: the architecture facts the decoders need, read from an HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from models.rope import rope_inv_freq


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
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama mlp_bias)
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
        # Checked before anything else reads the config: an unsupported model gets one
        # clear error, never a KeyError or silently wrong numbers.
        from models.registry import get_model_class

        get_model_class(arch)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true (a window on some layers) is not supported")
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
        rope_inv_freq(head_dim, float(rope_theta), rope)  # unsupported rope types fail here
        # HF: Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 put
        # attention_bias on all four projections.
        attention_bias = bool(cfg.get("attention_bias", False))
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
            attention_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=cfg.get("sliding_window") if use_sw and arch == "MistralForCausalLM" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )

    @staticmethod
    def from_pretrained(path: str | Path) -> "ModelArchConfig":
        return ModelArchConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))
