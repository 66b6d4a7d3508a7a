"""The decoders as pooling models (vLLM's ``model_executor/models/adapters.py``):

- ``*ForSequenceClassification`` (Llama, Qwen2, Qwen3): the decoder without lm_head and
  a score head ``score.weight`` [num_labels, D] on the pooled hidden state (HF pools
  the last token), for classifiers, reward models and cross-encoders;
- ``*Model`` (HF's ``AutoModel`` save of a decoder, as embedding models such as
  Qwen3-Embedding are published): the same decoder whose checkpoint names have no
  ``model.`` prefix, and no lm_head;
- a causal LM served as a classifier from its lm_head rows (vLLM's ``hf_overrides``
  ``classifier_from_token``, e.g. Qwen3-Reranker: the score is lm_head[yes] -
  lm_head[no], whose sigmoid is the softmax probability of "yes" at the last token).

Pooling itself (which token, carried across chunks) is the runner's
(jaxserve/runner/programs.py: pool_step); the model adds ``pool_head``, what comes after
the pooled hidden state on the device. A causal LM served as an embedding model
(``--convert embed``) keeps its own class: its ``pool_head`` is the identity.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models.base import Weight, make_param
from models.config import ModelArchConfig
from models.llama import LlamaForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.quantization import param_map


def num_labels(cfg: dict) -> int:
    """The classifier's outputs from config.json: id2label's size, else num_labels (HF's
    default 2); from lm_head rows (classifier_from_token): one per token, one for from_2_way_softmax."""
    if cfg.get("classifier_from_token_ids"):
        return 1 if cfg.get("method") == "from_2_way_softmax" else len(cfg["classifier_from_token_ids"])
    id2label = cfg.get("id2label")
    n = len(id2label) if id2label else int(cfg.get("num_labels", 2))
    if n < 1:
        raise ValueError(f"config.json: a sequence classifier needs num_labels >= 1, got {n}")
    return n


_SCORE = Weight("score.weight", ("hidden_size", "num_labels"), transpose=True)


class SequenceClassifier:
    """Mixin over a decoder class: no lm_head, a score head [D, num_labels] (float32)."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        arch = super().from_hf_config(cfg)
        ids = tuple(cfg.get("classifier_from_token_ids") or ())
        if ids:  # a causal LM checkpoint: its lm_head (or tied embedding) is read, the score made of its rows
            return dataclasses.replace(arch, num_labels=num_labels(cfg), score_from_token_ids=ids,
                                       score_two_way=cfg.get("method") == "from_2_way_softmax")
        # tie_word_embeddings: the decoder builds no lm_head (the checkpoint has none).
        return dataclasses.replace(arch, tie_word_embeddings=True, num_labels=num_labels(cfg))

    @classmethod
    def weight_map(cls, c: ModelArchConfig) -> dict[str, Weight]:
        if c.score_from_token_ids:
            return super().weight_map(c)
        return super().weight_map(c) | {"score": _SCORE}

    def __init__(self, config: ModelArchConfig, weights: dict, *, dtype=jnp.float32, **kwargs) -> None:
        super().__init__(config, weights, dtype=dtype, **kwargs)
        if config.score_from_token_ids:
            self.score = make_param("score", self._score_from_tokens(config), _SCORE, config, jnp.float32)
            return
        wm = param_map(type(self), config)
        # float32 whatever the serving dtype: [D, labels] is small, and scores are compared across requests.
        self.score = make_param("score", weights["score"], wm["score"], config, jnp.float32)

    def _score_from_tokens(self, config: ModelArchConfig):
        """[D, num_labels] float32 from the output rows of the classifier tokens; the lm_head
        is dropped after (a pooling model never computes logits)."""
        if jax.process_count() > 1:  # the rows are gathered eagerly, from arrays this process may not hold
            raise ValueError("hf_overrides classifier_from_token is not supported on a multi-process mesh yet")
        ids = jnp.asarray(config.score_from_token_ids)
        if config.tie_word_embeddings:
            rows = self.embed_tokens[...][ids].astype(jnp.float32).T  # [D, k]
        else:
            rows = self.lm_head[...][:, ids].astype(jnp.float32)  # [D, k]
            del self.lm_head
        if config.score_two_way:  # [false, true]: the logit of "true" against "false"
            rows = rows[:, 1:] - rows[:, :1]
        mesh = getattr(self, "mesh", None)  # replicated, as a checkpoint's score head is
        return jax.device_put(rows, NamedSharding(mesh, PartitionSpec())) if mesh is not None else rows

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
