"""Request: one sequence the engine is generating, as the scheduler sees it."""
from __future__ import annotations

import enum
import time
from typing import Callable

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # in the waiting queue until its grammar is compiled
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> "FinishReason | None":
        return _FINISHED_REASON_MAP.get(status)


class FinishReason(enum.IntEnum):
    """Why a request finished; str() gives the OpenAI finish_reason."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    """Token state of one request.

    Invariants: ``num_computed_tokens <= num_tokens``; ``block_hashes`` holds one
    hash per *full* block of ``all_token_ids`` (computed incrementally as tokens
    are appended, so the scheduler never rehashes a prompt).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "cache_salt", "status", "stop_reason", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "max_tokens", "block_hashes",
        "_all_token_ids", "_output_token_ids", "_block_hasher", "structured_output_request",
        "spec_token_ids", "num_spec_drafted", "num_spec_accepted", "spec_disabled",
        "num_output_placeholders", "lora_request", "scheduled_time", "mm",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: Callable[["Request"], list[bytes]] | None = None,
        max_tokens: int | None = None,
        lora_request=None,
        mm=None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # The LoRA adapter it runs with (jaxserve/lora/request.py), None: the base model.
        # Set before the block hashes: the adapter is part of every block's hash.
        self.lora_request = lora_request
        # Its images (jaxserve.multimodal.inputs.MultiModalPrompt), None: text only. Set
        # before the block hashes too: a block holding an image's tokens hashes its hash.
        self.mm = mm
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.scheduled_time: float | None = None  # time.monotonic() when first scheduled (tracing)
        self.num_preemptions = 0
        # max_tokens resolved by the input processor (None in params means "rest of the context").
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self._all_token_ids = list(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()
        # Set by the StructuredOutputManager for a constrained request.
        self.structured_output_request = None
        # Speculative decoding: the proposer's guesses for the next step (never part of
        # all_token_ids: they are unverified), and how this request's drafts fared
        # (decayed counts, for switching speculation off where it does not pay).
        self.spec_token_ids: list[int] = []
        self.num_spec_drafted = 0.0
        self.num_spec_accepted = 0.0
        self.spec_disabled = False
        # Async scheduling: tokens of steps scheduled but not yet returned (each such step
        # samples one); the scheduler counts them as already there.
        self.num_output_placeholders = 0

    # --- tokens -----------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # --- status -----------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
