"""Program keys: which compiled program of the step a call runs.

The warm-up compiles one program per key and serving looks them up by key, so the
set of keys is the set of programs (a sum over buckets, never a product: docs/design.md §3).
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
    """Logits + sampler for a request bucket; penalty-free batches get a cheaper variant
    (no token-history scatter). Greedy-only and plain batches (no request wants
    logprobs, none is grammar-constrained) are run-time flags of the same program: it
    skips the random draw, or the log-softmax, its top-k and the grammar mask (each a
    pass over [R, V]) with lax.cond, so one program serves the four cases."""

    num_reqs: int
    use_penalties: bool

    def static_args(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PromptLogprobsKey:
    """Logprobs of every prompt position of a step: the token bucket alone."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """Logits at every draft position + rejection sampling (speculative decoding) for a
    request bucket; greedy-only and penalty-free batches get cheaper variants (never
    plain: verification keeps its logprobs)."""

    num_reqs: int
    greedy_only: bool
    use_penalties: bool

    def static_args(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class DraftKey:
    """The draft model's proposal (speculative decoding, method draft_model): its first
    pass over a draft token bucket, then its k - 1 one-token passes."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


@dataclass(frozen=True, slots=True)
class EncoderKey:
    """A vision-language model's tower over ``num_windows`` attention windows of
    ``window_len`` patches each (runner/encoder.py); Gemma 3's SigLIP: over
    ``num_windows`` images, window_len 0."""

    num_windows: int
    window_len: int

    def static_args(self) -> dict:
        return {"window_len": self.window_len}


ProgramKey = ModelStepKey | SampleKey | PromptLogprobsKey | VerifyKey | DraftKey | EncoderKey


@dataclass(frozen=True, slots=True)
class PoolKey:
    """The pooling runner's head (docs/pooling.md): the pooled state of each request's
    tokens in the step (carried across its chunks), then the model's pool_head. The
    token bucket alone; the pooling type is the engine's."""

    num_tokens: int

    def static_args(self) -> dict:
        return {}


ProgramKey = ProgramKey | PoolKey
