"""PoolingParams (vLLM's): what a pooling request asks for, and ``finalize``, which turns
the runner's pooled output into it on the host (docs/pooling.md)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxserve.config import PoolerConfig

# Per request: embed (an embedding), classify (label probabilities), score (one number:
# a cross-encoder's, or the cosine of two embeddings, LLM.score), encode (the raw pooled
# output: the embedding unnormalized, or the classifier's logits; LLM.encode / reward).
POOLING_TASKS = ("embed", "classify", "score", "encode")
# The tasks each kind of model serves.
MODEL_TASKS = {"embed": ("embed", "score", "encode"), "classify": ("classify", "score", "encode")}


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """task: one of POOLING_TASKS (None: the model's own, embed or classify);
    normalize (embed): L2-normalize (None: the pooler config's); dimensions (embed,
    Matryoshka models only): keep the first ``dimensions`` values, before normalizing;
    use_activation (classify / score): softmax, or sigmoid with one label (None: the
    pooler config's); truncate_prompt_tokens: keep the prompt's last k tokens (-1:
    max_model_len's worth; None: no truncation, a longer prompt is an error)."""

    task: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}")

    def resolve(self, pooler: PoolerConfig, *, hidden_size: int, max_model_len: int) -> "PoolingParams":
        """The params with the task and defaults filled in from the model's pooler
        config; ValueError for what this model cannot do."""
        task = self.task or pooler.task
        if task not in MODEL_TASKS[pooler.task]:
            raise ValueError(f"task {task!r} is not served by this model (a {pooler.task} model: "
                             f"{', '.join(MODEL_TASKS[pooler.task])})")
        dims = self.dimensions if self.dimensions is not None else pooler.dimensions
        if self.dimensions is not None:
            if pooler.task != "embed" or task not in ("embed", "encode", "score"):
                raise ValueError("dimensions: only embedding requests take dimensions")
            if not pooler.is_matryoshka:
                raise ValueError("dimensions: the model does not support Matryoshka representation; changing its "
                                 "output dimensions would give poor embeddings")
            if pooler.matryoshka_dimensions and dims not in pooler.matryoshka_dimensions:
                raise ValueError(f"dimensions: the model supports {list(pooler.matryoshka_dimensions)}, got {dims}")
            if dims > hidden_size:
                raise ValueError(f"dimensions: at most the model's {hidden_size}, got {dims}")
        t = self.truncate_prompt_tokens
        if t is not None and t > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: at most max_model_len={max_model_len}, got {t}")
        return replace(self, task=task, dimensions=dims,
                       normalize=pooler.normalize if self.normalize is None else self.normalize,
                       use_activation=pooler.use_activation if self.use_activation is None else self.use_activation)

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt ids kept (the last truncate_prompt_tokens; -1: max_model_len)."""
        t = self.truncate_prompt_tokens
        if t is None:
            return ids
        k = max_model_len if t == -1 else t
        return ids[-k:]


def activation(x: np.ndarray) -> np.ndarray:
    """Label probabilities: softmax, or the sigmoid of a single logit (vLLM's, HF's CrossEncoder's)."""
    if x.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-x))
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def finalize(pooled: np.ndarray, params: PoolingParams, model_task: str) -> np.ndarray:
    """A request's output from the runner's pooled row (float32 [D] of an embedding
    model, [num_labels] of a classifier: ``model_task``) and its resolved params. An
    embedding model's "score" request returns its embedding (LLM.score takes the cosine)."""
    x = np.asarray(pooled, np.float32)
    if params.task == "encode":
        return x[:params.dimensions] if params.dimensions else x
    if model_task == "classify":
        return activation(x) if params.use_activation else x
    if params.dimensions:
        x = x[:params.dimensions]
    if params.normalize:
        x = x / max(float(np.linalg.norm(x)), 1e-12)
    return x
