"""Padded sizes the step compiles for, and O(1) lookup of the bucket for a size."""
from __future__ import annotations

import numpy as np


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
