"""Program keys: which compiled program of the step a call runs.

The warm-up compiles one program per key and serving looks them up by key, so the
set of keys is the set of programs (a sum over buckets, never a product: DESIGN §3).
Keys are frozen dataclasses, not tuples, so keys of different programs never compare
equal (a ModelStepKey(64) is not a PromptLogprobsKey(64)).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelStepKey:
    """The model backbone (embedding, decoder layers, KV write): the token bucket alone."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


@dataclass(frozen=True, slots=True)
class SampleKey:
    """Logits + sampler for a request bucket; greedy-only and penalty-free batches get
    cheaper variants (no random draw / no token-history scatter), and so do plain ones:
    no request wants logprobs and none is grammar-constrained, so the sampler skips the
    log-softmax, its top-k and the grammar mask (each a pass over [R, V])."""

    num_reqs: int
    greedy_only: bool
    use_penalties: bool
    plain: bool = False

    def static_args(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PromptLogprobsKey:
    """Logprobs of every prompt position of a step: the token bucket alone."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


@dataclass(frozen=True, slots=True)
class VerifyKey(SampleKey):
    """Logits at every draft position + rejection sampling (speculative decoding) for a
    request bucket; the same variants as SampleKey (never equal to one: dataclass
    equality compares the class)."""


@dataclass(frozen=True, slots=True)
class DraftKey:
    """The draft model's proposal (speculative decoding, method draft_model): its first
    pass over a draft token bucket, then its k - 1 one-token passes."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


ProgramKey = ModelStepKey | SampleKey | PromptLogprobsKey | VerifyKey | DraftKey
