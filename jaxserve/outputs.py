"""What flows back: runner -> scheduler (ModelRunnerOutput), scheduler -> output
processor (EngineCoreOutput), engine -> user (RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.request import FinishReason


@dataclass(slots=True)
class LogprobsLists:
    """Top-k logprobs for some positions. Column 0 is the sampled (or actual prompt)
    token, columns 1..k the top-k. Shapes: [M, k+1], [M, k+1], [M]."""

    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.sampled_token_ranks[start:end]
        )


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: the tokens sampled this step ([] for a request
    # still in the middle of its prefill).
    sampled_token_ids: list[list[int]]
    # The j-th new token of request req_ids[i] has row i * logprobs_stride + j
    # (logprobs_stride = 1 + the most draft tokens a request verifies; 1 without speculation).
    logprobs: LogprobsLists | None = None
    # Prompt logprobs computed this step, per request (only requests that asked).
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    logprobs_stride: int = 1
    # Speculative decoding: the proposer's next drafts, by request (those that have some).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The pooling runner: each request whose prompt ended this step -> its pooled output
    # (float32 [D] or [num_labels], before PoolingParams' normalization).
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], {}, [])


class RequestFailedError(RuntimeError):
    """The engine failed one request (its detokenizing, its grammar ...) and went on
    serving the others; the request has ended."""

    def __init__(self, request_id: str, message: str, client_error: bool = False) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        # The request itself was at fault (a grammar that validates but cannot be
        # compiled): a server answers 400, not 500.
        self.client_error = client_error


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set when the engine failed this request alone (its grammar broke, ...): the
    # request has ended (finish_reason abort) and its caller gets this error.
    error: str | None = None
    error_is_client: bool = False  # the request's own fault (see RequestFailedError.client_error)
    pooling_output: np.ndarray | None = None  # a pooling request's pooled output (it has finished)
    scheduled_time: float | None = None  # time.monotonic() when the request was first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict | None = None


# ------------------------------------------------------------------ pooling (docs/pooling.md)
@dataclass
class PoolingOutput:
    """data: a pooling request's output, float32 [D] (an embedding) or [num_labels]."""

    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    """A pooling request's result (vLLM's): ``outputs.data``; LLM.embed / classify /
    score return the typed views below, whose ``outputs`` name the value."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
