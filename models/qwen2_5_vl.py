"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE, and its vision tower (docs/models.md).

The decoder is Qwen2's, with three changes:
- its rotary positions are (temporal, height, width) triples ([3, T]), each turning its
  own block of frequencies (``mrope_section``; models/rope.py). Text tokens have three
  equal positions; an image's tokens sit on its grid (jaxserve/multimodal/qwen2_vl.py).
- the embeddings of an image's placeholder tokens are replaced by the tower's outputs
  (``mm``: rows of the runner's encoder-output buffer, one per token, -1 for text).
- the checkpoint holds the tower's tensors too, as ``visual.*`` next to the decoder's
  ``model.*`` (the Hub's layout, which transformers 5 still writes).

The tower (``VisionTower``) is a ViT over 14-pixel patches: RMSNorm pre-norm blocks
with a gated MLP, 2D rotary (rows and columns), attention within windows of merged
tokens except in ``fullatt_block_indexes`` (the whole image), then a merger that fuses
each 2x2 block of patches into one token of the decoder's width. It reads the padded,
window-ordered input of ``jaxserve.multimodal.qwen2_vl.vision_layout``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.base import MODEL, Weight, make_param
from models.config import ModelArchConfig, VisionConfig
from models.llama import rms_norm
from models.qwen2 import Qwen2ForCausalLM

VISUAL = "visual."
_EPS = 1e-6  # the tower's RMSNorms (HF hard-codes it)
_QUERY_WINDOWS = 8  # full-attention blocks attend this many windows of queries at a time


def vision_config(cfg: dict) -> VisionConfig:
    """config.json's ``vision_config`` -> VisionConfig (ValueError for what is not supported)."""
    v = cfg["vision_config"]
    act = v.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "quick_gelu", "gelu"):
        raise ValueError(f"vision_config.hidden_act {act!r} is not supported")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
        window_size=v.get("window_size", 112), fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
        in_channels=v.get("in_channels", 3), hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)))


def vision_weights(vc: VisionConfig, prefix: str = VISUAL) -> dict[str, Weight]:
    """The tower's params, one set per block (``visual.{j}.*``): q / k / v read as row
    blocks of the fused ``qkv``; under tensor parallelism (``vc.tensor_parallel``) the
    heads and the MLP columns are split over 'model' (q / k / v / gate / up by columns,
    proj / down by rows), the rest replicated."""
    C, I, O = str(vc.hidden_size), str(vc.intermediate_size), str(vc.out_hidden_size)
    M = str(vc.hidden_size * vc.spatial_merge_size ** 2)
    p = vc.patch_size
    cols, rows, split = ((None, MODEL), (MODEL, None), (MODEL,)) if vc.tensor_parallel else (None, None, None)
    m = {"visual.patch_embed": Weight(prefix + "patch_embed.proj.weight",
                                      (C, str(vc.in_channels), str(vc.temporal_patch_size), str(p), str(p)))}
    for j in range(vc.depth):
        b = f"{prefix}blocks.{j}."
        m |= {
            f"visual.{j}.norm1": Weight(b + "norm1.weight", (C,)),
            f"visual.{j}.norm2": Weight(b + "norm2.weight", (C,)),
            f"visual.{j}.proj": Weight(b + "attn.proj.weight", (C, C), rows, transpose=True),
            f"visual.{j}.proj_bias": Weight(b + "attn.proj.bias", (C,)),
        }
        for k, name in enumerate("qkv"):
            offset = str(k * vc.hidden_size)
            m[f"visual.{j}.{name}"] = Weight(b + "attn.qkv.weight", (C, C), cols, transpose=True, row_offset=offset,
                                             fused_rows="3*" + C)
            m[f"visual.{j}.{name}_bias"] = Weight(b + "attn.qkv.bias", (C,), split, row_offset=offset,
                                                  fused_rows="3*" + C)
        for name, (din, dout) in {"gate_proj": (C, I), "up_proj": (C, I), "down_proj": (I, C)}.items():
            down = name == "down_proj"
            m[f"visual.{j}.{name}"] = Weight(b + f"mlp.{name}.weight", (din, dout), rows if down else cols,
                                             transpose=True)
            m[f"visual.{j}.{name}_bias"] = Weight(b + f"mlp.{name}.bias", (dout,), None if down else split)
    m |= {
        "visual.merger_norm": Weight(prefix + "merger.ln_q.weight", (C,)),
        "visual.merger_fc1": Weight(prefix + "merger.mlp.0.weight", (M, M), transpose=True),
        "visual.merger_fc1_bias": Weight(prefix + "merger.mlp.0.bias", (M,)),
        "visual.merger_fc2": Weight(prefix + "merger.mlp.2.weight", (M, O), transpose=True),
        "visual.merger_fc2_bias": Weight(prefix + "merger.mlp.2.bias", (O,)),
    }
    return m


def _act(name: str, x):
    if name == "silu":
        return jax.nn.silu(x)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")


def _rotate(x, cos, sin):
    """Rotate-half rotary in float32. x: [..., heads, H]; cos, sin: [..., 1, H]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


class VisionTower(nnx.Module):
    """pixels [M, C*T*P*P] in ``vision_layout``'s order -> merged tokens [M / merge**2, out]."""

    def __init__(self, config: ModelArchConfig, weights: dict, dtype) -> None:
        vc = self.vc = config.vision
        self.params = nnx.Dict({n.removeprefix("visual.").replace(".", "_"): make_param(
            n, weights[n], w, config, dtype) for n, w in vision_weights(vc).items()})
        sd = vc.head_dim // 2
        self.inv_freq = nnx.Variable(1.0 / vc.rope_theta ** (jnp.arange(0, sd, 2, dtype=jnp.float32) / sd))

    def __call__(self, pixels, image_id, pos_hw, window_len: int):
        vc = self.vc
        p = {k: v[...] for k, v in self.params.items()}
        m, heads, hd = pixels.shape[0], vc.num_heads, vc.head_dim
        x = pixels.astype(p["patch_embed"].dtype) @ p["patch_embed"].reshape(vc.hidden_size, -1).T  # [M, C]
        freqs = pos_hw.astype(jnp.float32)[:, :, None] * self.inv_freq[...][None, None, :]  # [M, 2, H/4]
        emb = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)  # [M, H/2]
        emb = jnp.concatenate([emb, emb], -1)[:, None, :]  # [M, 1, H]
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        nw = m // window_len
        valid = image_id >= 0

        def attend(q, k, v, mask):
            s = jnp.einsum("...qnh,...knh->...nqk", q.astype(jnp.float32), k.astype(jnp.float32)) * hd ** -0.5
            s = jnp.where(mask[..., None, :, :], s, -1e30)
            a = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("...nqk,...knh->...qnh", a, v.astype(jnp.float32)).astype(q.dtype)

        def full_attention(q, k, v):
            # Whole images: query windows in groups of _QUERY_WINDOWS against every key.
            g = min(_QUERY_WINDOWS, nw)
            groups = -(-nw // g)
            pad = groups * g * window_len - m
            qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(groups, g * window_len, heads, hd)
            ip = jnp.pad(image_id, (0, pad), constant_values=-1).reshape(groups, g * window_len)

            def group(args):
                qg, ig = args
                mask = (ig[:, None] == image_id[None, :]) & (ig[:, None] >= 0)
                return attend(qg, k, v, mask)

            return jax.lax.map(group, (qp, ip)).reshape(-1, heads, hd)[:m]

        for j in range(vc.depth):
            h = rms_norm(x, p[f"{j}_norm1"], _EPS)
            q, k, v = ((h @ p[f"{j}_{n}"] + p[f"{j}_{n}_bias"]).reshape(m, heads, hd) for n in "qkv")
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if j in vc.fullatt_block_indexes:
                o = full_attention(q, k, v)
            else:
                w = lambda a: a.reshape(nw, window_len, *a.shape[1:])
                wmask = w(valid)[:, :, None] & w(valid)[:, None, :]
                o = attend(w(q), w(k), w(v), wmask).reshape(m, heads, hd)
            x = x + (o.reshape(m, -1) @ p[f"{j}_proj"] + p[f"{j}_proj_bias"])
            h = rms_norm(x, p[f"{j}_norm2"], _EPS)
            gate = h @ p[f"{j}_gate_proj"] + p[f"{j}_gate_proj_bias"]
            up = h @ p[f"{j}_up_proj"] + p[f"{j}_up_proj_bias"]
            x = x + (_act(vc.hidden_act, gate) * up) @ p[f"{j}_down_proj"] + p[f"{j}_down_proj_bias"]
        h = rms_norm(x, p["merger_norm"], _EPS).reshape(m // vc.spatial_merge_size ** 2, -1)
        h = jax.nn.gelu(h @ p["merger_fc1"] + p["merger_fc1_bias"], approximate=False)
        return h @ p["merger_fc2"] + p["merger_fc2_bias"]  # [M / merge**2, out]


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    architectures = ("Qwen2_5_VLForConditionalGeneration",)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        # transformers 5 nests the decoder's fields in text_config; older configs keep
        # them at the top with rope_scaling {"type": "mrope", "mrope_section": [...]}.
        text = {**cfg, **(cfg.get("text_config") or {}), "architectures": cfg["architectures"]}
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = tuple(rope.pop("mrope_section", ()))
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text.pop("rope_scaling", None)
        text["rope_parameters"] = {**rope, "rope_theta": rope.get("rope_theta", text.get("rope_theta", 1000000.0))}
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        arch = super().from_hf_config(text)
        if not section or sum(section) * 2 != arch.head_dim:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = {arch.head_dim // 2}")
        return dataclasses.replace(arch, vision=vision_config(cfg), image_token_id=cfg["image_token_id"],
                                   mrope_section=section)

    @classmethod
    def weight_map(cls, c: ModelArchConfig):
        return super().weight_map(c) | vision_weights(c.vision)

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, param_dtype=None,
                 scan_layers: bool = True, mesh=None) -> None:
        super().__init__(config, {n: w for n, w in weights.items() if not n.startswith("visual.")}, dtype=dtype,
                         param_dtype=param_dtype, scan_layers=scan_layers, mesh=mesh)
        self.visual = VisionTower(config, weights, dtype)

    def encode_images(self, pixels, image_id, pos_hw, window_len: int):
        """The tower: ``vision_layout``'s padded input -> merged tokens [M / merge**2, D]."""
        return self.visual(pixels, image_id, pos_hw, window_len).astype(self.dtype)
