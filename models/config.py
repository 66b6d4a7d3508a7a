"""ModelArchConfig: the architecture facts the decoders need, read from an HF config.json.

The model class of the config's architecture reads it (its ``from_hf_config``);
``hf_common_fields`` is what every decoder reads the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from models.registry import get_model_class
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
    sliding_window: int | None = None
    # Which layers use sliding_window (Gemma: interleaved); None: all of them.
    sliding_window_layers: tuple[bool, ...] | None = None
    attn_logit_softcapping: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (default head_dim)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling)
    # Mixture of experts (models/moe.py); num_experts 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's mlp dim
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on gated expert (0: none)
    moe_bias: bool = False  # GPT-OSS: the router and the experts' projections carry biases
    # GPT-OSS's clamped SwiGLU in the experts, (alpha, limit) (models/moe.py: glu); None: SiLU * up.
    swiglu: tuple[float, float] | None = None
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each softmax's denominator
    # Multi-head Latent Attention (DeepSeek-V2 / V3, models/deepseek.py); kv_lora_rank 0: none.
    # Each token caches one latent of kv_lora_rank plus its rope key of head_dim (the rope
    # dims, qk_rope_head_dim): the KV cache is [L, P, S, 1, kv_lora_rank + head_dim].
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj is one matrix (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_head_dim: int = 0  # qk_nope_head_dim + the rope dims
    v_head_dim: int = 0
    softmax_scale: float | None = None  # the scores' scale when it is not head_dim ** -0.5 (MLA's)
    rope_interleave: bool = False  # rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek), not halves
    # DeepSeek's MoE: the first dense_layers layers have a dense MLP, the other sparse_layers
    # the experts; group-limited routing (n_group groups, the best topk_group of them),
    # softmax or sigmoid scores, a correction bias for the choice (V3), weights scaled by
    # routed_scaling_factor; shared experts: shared_expert_intermediate_size, ungated.
    dense_layers: int = 0
    sparse_layers: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    group_score: str = "max"  # a group's score: its best expert ("max", V2) or best two ("top2", V3)
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    # Experts laid out over the 'model' axis whole (E / tp per device) instead of split
    # by their mlp dim (models/sharding.py: arch_for_tensor_parallel).
    expert_parallel: bool = False
    # Weight-only quantization of the projections at load (models/quantization.py).
    quantization: str | None = None
    # quantization "int4", "fp8-block" or "mxfp4" (models/quantization.py GROUP_SCALED): a packed
    # checkpoint's projections kept as stored, codes with a scale per group of input rows:
    # these params, in groups of group_size input rows (0: one group, per output
    # channel), each input row's group looked up (act_order: GPTQ's desc_act).
    grouped_params: tuple[str, ...] = ()
    group_size: int = 0
    act_order: bool = False
    # (k_scale, v_scale) of a float8 KV cache, from the checkpoint (kv_cache_scheme); None: 1.0.
    kv_cache_scales: tuple[float, float] | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Tensor parallelism (models/sharding.py: arch_for_tensor_parallel). The embedding and
    # lm_head have padded_vocab_size rows, vocab_size rounded up to a multiple of tp (the
    # extra rows are zeros and their logits are never returned); each checkpoint KV head
    # appears kv_head_replicas times, and num_key_value_heads counts the copies.
    padded_vocab_size: int | None = None  # None: vocab_size
    kv_head_replicas: int = 1
    # Sequence classifiers (models/adapters.py, models/bert.py): the score head's outputs; 0 for the others.
    num_labels: int = 0
    # Encoders (models/bert.py): token types, and the first position id (XLM-R: padding_idx + 1).
    type_vocab_size: int = 0
    position_offset: int = 0
    num_position_embeddings: int = 0  # the position table's rows (max_position_embeddings + position_offset)
    # A causal LM served as a classifier from its lm_head rows (vLLM's hf_overrides
    # classifier_from_token, e.g. Qwen3-Reranker; models/adapters.py): the token ids, and
    # whether the score is the difference of two rows (from_2_way_softmax: one label).
    score_from_token_ids: tuple[int, ...] = ()
    score_two_way: bool = False
    # Vision-language models (models/qwen2_5_vl.py): the vision tower, the placeholder
    # token an image's embeddings replace, and M-RoPE's split of the rotary frequencies
    # over the (temporal, height, width) positions; () : one position per token.
    vision: "VisionConfig | None" = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] = ()
    # Gemma 3: an image's tokens attend to each other both ways (every token of the image
    # sees all of it, on sliding and global layers), so an image is never split across
    # prefill chunks (the attention's keys_ahead, pallas_kernels/backend.py).
    mm_bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)

    @property
    def latent_kv(self) -> bool:
        """The KV cache holds MLA's one latent row per token (1 row, not 2K)."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_rows(self) -> tuple[int, int]:
        """(rows, width) of one token's KV in one layer: (2K, head_dim), or MLA's (1,
        kv_lora_rank + rope dims)."""
        if self.latent_kv:
            return 1, self.kv_lora_rank + self.head_dim
        return 2 * self.num_key_value_heads, self.head_dim

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field")
        # The registry answers before anything reads the config: an unsupported model
        # gets one clear error, never a KeyError or silently wrong numbers.
        return get_model_class(archs[0]).from_hf_config(cfg)

    @staticmethod
    def from_pretrained(path: str | Path, hf_overrides: dict | None = None) -> "ModelArchConfig":
        """``hf_overrides``: applied on top of config.json (vLLM's ``--hf-overrides``)."""
        cfg = read_hf_config(path, hf_overrides)
        # A *ForCausalLM config over HF's *Model tensors (Qwen3-Embedding ships so) is the *Model.
        arch = checkpoint_architecture(Path(path), cfg)
        if arch != (cfg.get("architectures") or [None])[0]:
            cfg = {**cfg, "architectures": [arch]}
        return ModelArchConfig.from_hf_dict(cfg)


def merge_hf_overrides(cfg: dict, overrides: dict | None) -> dict:
    """config.json with ``overrides`` on top; a nested object is merged key by key (as
    vLLM updates a sub-config), anything else replaced."""
    out = dict(cfg)
    for key, value in (overrides or {}).items():
        out[key] = merge_hf_overrides(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def read_hf_config(path: str | Path, hf_overrides: dict | None = None) -> dict:
    """A model folder's config.json as the engine serves it: with ``hf_overrides`` applied."""
    return merge_hf_overrides(json.loads((Path(path) / "config.json").read_text()), hf_overrides)


def checkpoint_architecture(folder: Path, cfg: dict) -> str | None:
    """The architecture a folder is served as: config.json's, except that a
    ``*ForCausalLM`` whose safetensors hold HF's ``*Model`` tensors (no ``model.`` prefix:
    Qwen3-Embedding's layout) is that ``*Model``. Only the files' headers are read."""
    import struct

    from models.registry import POOLING_ARCHITECTURES

    arch = (cfg.get("architectures") or [None])[0]
    base = arch.removesuffix("ForCausalLM") + "Model" if arch else None
    files = sorted(Path(folder).glob("*.safetensors"))
    if base not in POOLING_ARCHITECTURES or not files:
        return arch
    names = set()
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names |= set(json.loads(f.read(size))) - {"__metadata__"}
    if "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names):
        return base
    return arch


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower (config.json's ``vision_config``): Qwen2.5-VL's windowed ViT
    (``kind`` "qwen2_5_vl") or Gemma 3's SigLIP with its pooling projector ("siglip",
    models/gemma3_vl.py: the window fields unused, ``image_size`` and
    ``tokens_per_image`` set)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size (the merger's output)
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # pixels per side of an attention window
    fullatt_block_indexes: tuple[int, ...]  # blocks that attend over the whole image
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    # Heads and MLP columns split over the 'model' axis (models/sharding.py sets it when
    # tensor parallelism divides them; else the tower is replicated).
    tensor_parallel: bool = False
    kind: str = "qwen2_5_vl"
    # SigLIP (Gemma 3): the square input side in pixels, the tokens each image becomes
    # after the projector's average pooling, the LayerNorms' epsilon, and the tokens that
    # open and close an image in the prompt (the chat template writes the opening one).
    image_size: int = 0
    tokens_per_image: int = 0
    layer_norm_eps: float = 1e-6
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One patch's values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_merged(self) -> int:
        """An attention window's side in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def attention_settings(arch: ModelArchConfig) -> dict:
    """The keyword arguments of pallas_kernels.backend.build_attention for this model."""
    scale = arch.softmax_scale or (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
    return dict(sm_scale=scale, sliding_window=arch.sliding_window, sliding_window_layers=arch.sliding_window_layers,
                soft_cap=arch.attn_logit_softcapping, latent_kv=arch.latent_kv)


def hf_common_fields(cfg: dict) -> dict:
    """The ModelArchConfig fields every decoder reads the same way from config.json
    (sizes, head_dim, rope, bos/eos); a model's from_hf_config adds its own flags."""
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    # transformers >= 5 folds rope_theta / rope_scaling into rope_parameters.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    rope["rope_type"] = rope_type
    rope.pop("type", None)
    if rope_type == "yarn" and not rope.get("factor") and rope.get("original_max_position_embeddings"):
        rope["factor"] = cfg.get("max_position_embeddings", 2048) / rope["original_max_position_embeddings"]  # HF's rule
    eos = cfg.get("eos_token_id")
    eos_list = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    rope_inv_freq(head_dim, float(rope_theta), rope)  # unsupported rope types fail here
    return dict(
        architecture=cfg["architectures"][0],
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
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos_list,
    )
