"""Engine statistics: what the AsyncLLM engine thread publishes for stat loggers
(server/metrics.py's PrometheusStatLogger is one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jaxserve.core.sched.scheduler import SpecDecodingStats


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # seconds from arrival to the final output
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None  # None: finished before any token (abort)
    mean_time_per_output_token: float | None  # (e2e - ttft) / (tokens - 1); None if < 2 tokens


@dataclass
class IterationStats:
    """What one engine-loop iteration produced (for stat loggers)."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived this iteration
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # per output, per choice
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None  # this iteration's drafts (speculative decoding)


@dataclass(frozen=True)
class RankStats:
    """One data-parallel rank's share (its own scheduler and KV cache)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every loop iteration."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_unfinished_requests: int = 0  # engine-side, children of n > 1 counted separately
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens found in the cache
    prefix_cache_hit_rate: float = 0.0  # over the most recent requests
    num_preemptions: int = 0
    num_steps: int = 0
    ranks: tuple[RankStats, ...] = ()  # per data-parallel rank; the fields above are their total
    # LoRA (max_loras 0: off): the adapters' names with running / waiting requests.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0


class StatLogger(Protocol):
    def record(self, engine_stats: EngineStats, iteration_stats: IterationStats | None) -> None:
        """Called on the engine thread after each iteration; must be quick and thread-safe."""
