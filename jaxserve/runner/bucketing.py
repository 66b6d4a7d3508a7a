"""Padded sizes the step compiles for: the buckets an engine uses, and O(1) lookup of
the bucket for a size."""
from __future__ import annotations

import numpy as np

from jaxserve.config import EngineConfig

# The smallest token bucket on an accelerator, and on every platform the one the first
# warm-up stage holds besides the smallest (CompilationManager.warmup_stages).
MIN_TOKEN_BUCKET = 16
MIN_REQUEST_BUCKET = 8


def power_of_two_buckets(floor: int, maximum: int) -> tuple[int, ...]:
    """floor, 2*floor, ... up to and including maximum (maximum always the last bucket)."""
    out, b = [], max(1, floor)
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return tuple(out)


def default_buckets(floor: int, maximum: int, *, single: bool) -> tuple[int, ...]:
    """power_of_two_buckets(floor, maximum), led by a bucket of 1 when ``single``."""
    buckets = power_of_two_buckets(floor, maximum)
    return (1, *buckets) if single and buckets[0] > 1 else buckets


class BucketTable:
    """Maps a size in [1, max] to the smallest bucket >= size via a lookup array."""

    def __init__(self, buckets: tuple[int, ...] | list[int]) -> None:
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive, got {buckets}")
        self.max = self.buckets[-1]
        self._lookup = np.zeros(self.max + 1, np.int64)
        lo = 0
        for b in self.buckets:
            self._lookup[lo : b + 1] = b
            lo = b + 1

    def __call__(self, n: int) -> int:
        if n > self.max:
            raise ValueError(f"size {n} exceeds the largest bucket {self.max}")
        return int(self._lookup[n])

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)


def step_buckets(config: EngineConfig, platform: str) -> tuple[BucketTable, BucketTable]:
    """(token buckets, request buckets) of the step: the configured ones, else powers of
    two up to max_num_batched_tokens and max_num_seqs.

    On a CPU, a step of one token (and the sampler of one request) gets a bucket of
    its own: its matmuls are then matrix-vector products, which XLA:CPU streams at
    memory speed, where [16, K] @ [K, N] goes through Eigen's GEMM, which packs the
    weights first: a [576, 3072] matmul over 30 weight sets was ~5x faster with 1 row
    than with 16, and SmolLM2's batch-1 decode step ~4x. Below 16 rows the GEMM's
    time still grows with the rows, so the CPU's token buckets are every power of two
    from 1 (SmolLM2 decode steps of 2 / 8 requests were 1.6x / 1.3x faster in their own
    buckets than in the 16 one). Accelerators pad small shapes anyway."""
    sc, single = config.scheduler_config, platform == "cpu"
    tokens = BucketTable(config.token_buckets or default_buckets(
        1 if single else MIN_TOKEN_BUCKET, sc.max_num_batched_tokens, single=single))
    requests = BucketTable(config.request_buckets or default_buckets(
        min(MIN_REQUEST_BUCKET, sc.max_num_seqs), sc.max_num_seqs, single=single))
    return tokens, requests
