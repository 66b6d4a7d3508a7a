"""SchedulerOutput: the diff the scheduler sends the runner each step.

The runner keeps persistent per-request state, so only changes travel:
new requests in full (NewRequestData), requests it already knows as deltas
(CachedRequestData), and the ids of finished / preempted requests to drop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.lora.request import LoRARequest
    import numpy as np

from jaxserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has never seen (or has forgotten)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # every block the request owns, in order, per KV cache group
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    lora_request: LoRARequest | None = None  # its adapter (jaxserve/lora), None: the base model
    mm: object = None  # its images (jaxserve.multimodal.inputs.MultiModalPrompt), None: text only


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as parallel lists indexed like req_ids."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and is back; new_block_ids then *replace* its
    # block table (its old blocks were freed) instead of extending it.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per KV cache group
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step; every scheduled request is a key.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished since the last step: the runner drops their state.
    finished_req_ids: set[str]
    # Requests preempted in this schedule(): the runner removes them from the batch
    # but keeps their token state for when they resume.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Constrained requests that sample this step and their packed next-token masks,
    # row i for structured_output_request_ids[i]: [n, ceil(V/32)] int32 (bit t of word
    # t // 32 set = token t allowed); None when no scheduled request is constrained.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token
    # (counted in num_scheduled_tokens); only requests with drafts are keys.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Images: those the vision tower encodes before this step's model step, mm_hash ->
    # (MultiModalFeature, its rows of the encoder-output buffer), and the rows of every
    # image whose placeholder tokens this step computes (mm_hash -> rows, token order).
    scheduled_encoder_inputs: dict = field(default_factory=dict)
    encoder_rows: dict[str, list[int]] = field(default_factory=dict)
