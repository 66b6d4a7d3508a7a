"""The decoders as pooling models (vLLM's ``model_executor/models/adapters.py``):

- ``*ForSequenceClassification`` (Llama, Qwen2, Qwen3): the decoder without lm_head and
  a score head ``score.weight`` [num_labels, D] on the pooled hidden state (HF pools
  the last token), for classifiers, reward models and cross-encoders;
- ``*Model`` (HF's ``AutoModel`` save of a decoder, as embedding models such as
  Qwen3-Embedding are published): the same decoder whose checkpoint names have no
  ``model.`` prefix, and no lm_head.

Pooling itself (which token, carried across chunks) is the runner's
(jaxserve/runner/programs.py: pool_step); the model adds ``pool_head``, what comes after
the pooled hidden state on the device. A causal LM served as an embedding model
(``--convert embed``) keeps its own class: its ``pool_head`` is the identity.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.base import Weight, make_param
from models.config import ModelArchConfig
from models.llama import LlamaForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.quantization import param_map


def num_labels(cfg: dict) -> int:
    """The classifier's outputs from config.json: id2label's size, else num_labels (HF's default 2)."""
    id2label = cfg.get("id2label")
    n = len(id2label) if id2label else int(cfg.get("num_labels", 2))
    if n < 1:
        raise ValueError(f"config.json: a sequence classifier needs num_labels >= 1, got {n}")
    return n


class SequenceClassifier:
    """Mixin over a decoder class: no lm_head, a score head [D, num_labels] (float32)."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        arch = super().from_hf_config(cfg)
        # tie_word_embeddings: the decoder builds no lm_head (the checkpoint has none).
        return dataclasses.replace(arch, tie_word_embeddings=True, num_labels=num_labels(cfg))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        return super().weight_map(c) | {"score": Weight("score.weight", ("hidden_size", "num_labels"), transpose=True)}

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, **kwargs) -> None:
        super().__init__(config, weights, dtype=dtype, **kwargs)
        wm = param_map(type(self), config)
        # float32 whatever the serving dtype: [D, labels] is small, and scores are compared across requests.
        self.score = make_param("score", weights["score"], wm["score"], config, jnp.float32)

    def pool_head(self, pooled):
        """pooled [R, D] -> the score head's logits [R, num_labels] (float32)."""
        return pooled.astype(jnp.float32) @ self.score[...]


class BaseModel:
    """Mixin over a decoder class: HF's ``*Model`` checkpoint (names without ``model.``, no lm_head)."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        return dataclasses.replace(super().from_hf_config(cfg), tie_word_embeddings=True)

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        return {n: dataclasses.replace(w, hf_name=w.hf_name.removeprefix("model."))
                for n, w in super().weight_map(c).items()}


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    architectures = ("LlamaForSequenceClassification",)


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    architectures = ("Qwen2ForSequenceClassification",)


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    architectures = ("Qwen3ForSequenceClassification",)


class LlamaModel(BaseModel, LlamaForCausalLM):
    architectures = ("LlamaModel",)


class Qwen2Model(BaseModel, Qwen2ForCausalLM):
    architectures = ("Qwen2Model",)


class Qwen3Model(BaseModel, Qwen3ForCausalLM):
    architectures = ("Qwen3Model",)
