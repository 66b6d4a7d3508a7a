"""Gemma 3 with images: Gemma 3's decoder, a SigLIP vision tower and its projector
(docs/models.md, docs/vision.md).

- The tower (``SiglipTower``) is a plain ViT over ``patch_size`` squares of one fixed
  ``image_size`` square (896 px, 64 x 64 patches on the Hub's checkpoints): learned
  position embeddings, pre-LayerNorm blocks with full attention over the image and a
  GELU (tanh) MLP, a final LayerNorm. No window, no rotary, no merger.
- The projector average-pools the patch grid down to ``tokens_per_image`` tokens
  (16 x 16 on the Hub), applies Gemma's RMSNorm (1 + w) and one matmul to the
  decoder's width. Those embeddings replace the image's ``<image_soft_token>``s after
  the decoder's embedding scale (sqrt(hidden), which text embeddings get and image
  embeddings do not, as in HF).
- In the decoder an image's tokens attend to each other both ways, on the sliding
  layers too (HF: AND(sliding window, OR(causal, same image))): the attention's
  ``keys_ahead`` (pallas_kernels/backend.py), filled per token by the runner
  (``mm_bidirectional``), and the scheduler never cuts an image across two chunks.

The checkpoint's names are the Hub's (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``), which transformers 5
still writes, less ``vision_model.`` (models/weights.py reads both).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import MODEL, Weight, make_param
from models.bert import layer_norm
from models.config import ModelArchConfig, VisionConfig
from models.gemma2 import gemma_rms_norm
from models.gemma3 import Gemma3ForCausalLM

TOWER = "vision_tower."
# The tower's attention runs one (image, head, block of this many queries) at a time:
# plain 2D products whose scores [block, patches] (16 MiB in float32 for the Hub's 4096
# patches) stay in cache. On the 2-core CI VM (12 heads x 4096 patches of 64) one
# layer's attention took 218 ms so, 651 ms as one [heads, 1024, 4096] einsum per query
# block, 1244 ms through jax.nn.dot_product_attention, 325 ms in torch's SDPA.
QUERY_BLOCK = 1024
PROJECTOR = "multi_modal_projector."
_TEXT = "language_model."


def vision_config(cfg: dict) -> VisionConfig:
    """config.json's SigLIP ``vision_config`` and Gemma 3's image fields -> VisionConfig."""
    v = cfg["vision_config"]
    if v.get("vision_use_head"):
        raise ValueError("vision_config.vision_use_head: SigLIP's pooling head is not used by Gemma 3")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"vision_config.hidden_act {act!r} is not supported")
    image_size, patch = v.get("image_size", 224), v.get("patch_size", 16)
    tokens = cfg.get("mm_tokens_per_image", 256)
    side, per_side = image_size // patch, int(round(tokens ** 0.5))
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                         f"{side} patches per side")
    return VisionConfig(
        depth=v.get("num_hidden_layers", 12), hidden_size=v.get("hidden_size", 768),
        intermediate_size=v.get("intermediate_size", 3072), num_heads=v.get("num_attention_heads", 12),
        out_hidden_size=(cfg.get("text_config") or cfg)["hidden_size"], patch_size=patch, temporal_patch_size=1,
        spatial_merge_size=1, window_size=0, fullatt_block_indexes=(), in_channels=v.get("num_channels", 3),
        hidden_act=act, kind="siglip", image_size=image_size, tokens_per_image=tokens,
        layer_norm_eps=v.get("layer_norm_eps", 1e-6), boi_token_id=cfg.get("boi_token_index"),
        eoi_token_id=cfg.get("eoi_token_index"))


def tower_weights(vc: VisionConfig) -> dict[str, Weight]:
    """The tower's and the projector's params (``vision.*``); under tensor parallelism
    (``vc.tensor_parallel``) the heads and the MLP's columns are split over 'model'
    (q / k / v / fc1 by columns, out_proj / fc2 by rows), the rest replicated."""
    C, I = str(vc.hidden_size), str(vc.intermediate_size)
    N = str((vc.image_size // vc.patch_size) ** 2)
    p = str(vc.patch_size)
    cols, rows, split = ((None, MODEL), (MODEL, None), (MODEL,)) if vc.tensor_parallel else (None, None, None)
    e = TOWER + "embeddings."
    m = {"vision.patch_embed": Weight(e + "patch_embedding.weight", (C, str(vc.in_channels), p, p)),
         "vision.patch_bias": Weight(e + "patch_embedding.bias", (C,)),
         "vision.pos_embed": Weight(e + "position_embedding.weight", (N, C))}
    for j in range(vc.depth):
        b = f"{TOWER}encoder.layers.{j}."
        for norm in ("layer_norm1", "layer_norm2"):
            m[f"vision.{j}.{norm}"] = Weight(b + norm + ".weight", (C,))
            m[f"vision.{j}.{norm}_bias"] = Weight(b + norm + ".bias", (C,))
        for name in ("q_proj", "k_proj", "v_proj"):
            m[f"vision.{j}.{name}"] = Weight(b + f"self_attn.{name}.weight", (C, C), cols, transpose=True)
            m[f"vision.{j}.{name}_bias"] = Weight(b + f"self_attn.{name}.bias", (C,), split)
        m[f"vision.{j}.out_proj"] = Weight(b + "self_attn.out_proj.weight", (C, C), rows, transpose=True)
        m[f"vision.{j}.out_proj_bias"] = Weight(b + "self_attn.out_proj.bias", (C,))
        m[f"vision.{j}.fc1"] = Weight(b + "mlp.fc1.weight", (C, I), cols, transpose=True)
        m[f"vision.{j}.fc1_bias"] = Weight(b + "mlp.fc1.bias", (I,), split)
        m[f"vision.{j}.fc2"] = Weight(b + "mlp.fc2.weight", (I, C), rows, transpose=True)
        m[f"vision.{j}.fc2_bias"] = Weight(b + "mlp.fc2.bias", (C,))
    return m | {
        "vision.post_norm": Weight(TOWER + "post_layernorm.weight", (C,)),
        "vision.post_norm_bias": Weight(TOWER + "post_layernorm.bias", (C,)),
        "vision.soft_emb_norm": Weight(PROJECTOR + "mm_soft_emb_norm.weight", (C,)),
        "vision.projection": Weight(PROJECTOR + "mm_input_projection_weight", (C, str(vc.out_hidden_size))),
    }


class SiglipTower(nnx.Module):
    """pixels [B, N, C*P*P] (B images of N patches, rows in raster order) -> the
    projector's tokens [B * tokens_per_image, D]."""

    def __init__(self, config: ModelArchConfig, weights: dict, dtype) -> None:
        self.vc = config.vision
        self.params = nnx.Dict({n.removeprefix("vision.").replace(".", "_"): make_param(
            n, weights[n], w, config, dtype) for n, w in tower_weights(self.vc).items()})

    def __call__(self, pixels):
        vc = self.vc
        p = {k: v[...] for k, v in self.params.items()}
        b, n, _ = pixels.shape
        heads, hd, eps = vc.num_heads, vc.hidden_size // vc.num_heads, vc.layer_norm_eps
        dt = p["patch_embed"].dtype
        x = pixels.astype(dt) @ p["patch_embed"].reshape(vc.hidden_size, -1).T + p["patch_bias"]
        x = x + p["pos_embed"][None]  # [B, N, C]
        qb = min(QUERY_BLOCK, n)
        nb = -(-n // qb)

        def attention(q, k, v):
            """q, k, v [B, N, heads, hd] -> [B, N, heads * hd]: every (image, head,
            query block) on its own, normalised after the product with the values."""
            qh, kh, vh = (a.astype(jnp.float32).transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, heads, N, hd]
            qs = jnp.pad(qh * hd ** -0.5, ((0, 0), (0, 0), (0, nb * qb - n), (0, 0))).reshape(-1, qb, hd)
            pair = jnp.arange(b * heads * nb) // nb  # the (image, head) of each block
            kh, vh = kh.reshape(b * heads, n, hd), vh.reshape(b * heads, n, hd)

            def block(args):
                qq, i = args
                s = qq @ kh[i].T  # [qb, N]
                e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
                return (e @ vh[i]) / jnp.sum(e, axis=-1, keepdims=True)

            o = jax.lax.map(block, (qs, pair)).reshape(b, heads, nb * qb, hd)[:, :, :n]
            return o.transpose(0, 2, 1, 3).reshape(b, n, heads * hd).astype(dt)

        for j in range(vc.depth):
            h = layer_norm(x, p[f"{j}_layer_norm1"], p[f"{j}_layer_norm1_bias"], eps)
            q, k, v = ((h @ p[f"{j}_{t}_proj"] + p[f"{j}_{t}_proj_bias"]).reshape(b, n, heads, hd) for t in "qkv")
            o = attention(q, k, v)
            x = x + o @ p[f"{j}_out_proj"] + p[f"{j}_out_proj_bias"]
            h = layer_norm(x, p[f"{j}_layer_norm2"], p[f"{j}_layer_norm2_bias"], eps)
            h = jax.nn.gelu(h @ p[f"{j}_fc1"] + p[f"{j}_fc1_bias"], approximate=vc.hidden_act == "gelu_pytorch_tanh")
            x = x + h @ p[f"{j}_fc2"] + p[f"{j}_fc2_bias"]
        x = layer_norm(x, p["post_norm"], p["post_norm_bias"], eps)
        # The projector: average pooling of the patch grid (raster order) in windows of
        # k x k patches, then Gemma's RMSNorm and the projection.
        side = vc.image_size // vc.patch_size
        ts = int(round(vc.tokens_per_image ** 0.5))
        k = side // ts
        pooled = x.astype(jnp.float32).reshape(b, ts, k, ts, k, -1).mean(axis=(2, 4)).astype(dt)
        pooled = gemma_rms_norm(pooled.reshape(b * ts * ts, -1), p["soft_emb_norm"], eps)
        return pooled @ p["projection"]  # [B * tokens, D]


def _text_weight(w: Weight) -> Weight:
    """A decoder param under the Hub's ``language_model.`` prefix."""
    return dataclasses.replace(w, hf_name=_TEXT + w.hf_name)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    architectures = ("Gemma3ForConditionalGeneration",)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        # The Hub's configs leave most fields to transformers' defaults (its text_config
        # names a few sizes only) and use transformers 4's rope_scaling: read them as
        # transformers does.
        import transformers

        full = transformers.Gemma3Config.from_dict(cfg).to_dict()
        text = {**full["text_config"], "architectures": cfg["architectures"]}
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if cfg.get(k) is not None:  # the top level's (the Hub: eos [1, 106], end_of_turn too)
                text[k] = cfg[k]
        arch = super().from_hf_config(text)
        return dataclasses.replace(arch, vision=vision_config(full), image_token_id=full.get("image_token_index"),
                                   mm_bidirectional=True)

    @classmethod
    def weight_map(cls, c: ModelArchConfig):
        return {n: _text_weight(w) for n, w in super().weight_map(c).items()} | tower_weights(c.vision)

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, param_dtype=None,
                 scan_layers: bool = True, mesh=None) -> None:
        super().__init__(config, {n: w for n, w in weights.items() if not n.startswith("vision.")}, dtype=dtype,
                         param_dtype=param_dtype, scan_layers=scan_layers, mesh=mesh)
        self.vision_tower = SiglipTower(config, weights, dtype)

    def encode_images(self, pixels):
        """pixels [B, N, C*P*P] -> the images' token embeddings [B * tokens_per_image, D]."""
        return self.vision_tower(pixels).astype(self.dtype)
