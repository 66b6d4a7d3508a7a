"""EncoderCacheManager: which images' vision-tower outputs sit in the runner's
encoder-output buffer, and where (vLLM's encoder cache manager; docs/design.md §13).

The buffer has ``capacity`` rows, one per image token. An image is encoded once into
rows the manager picks and is named by its hash, so an image that several requests
(or a later turn) send is encoded once while its rows are kept. A request references
an image from when its tokens are first scheduled until all of them have been
computed; an image no request references stays (reusable by its hash) until its rows
are needed for another, oldest first.
"""
from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_rows: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: rows 0, 1, ...
        self.rows: dict[str, list[int]] = {}  # mm_hash -> its rows, in token order
        self.refs: dict[str, set[str]] = {}  # mm_hash -> the requests that use it
        self.unreferenced: OrderedDict[str, None] = OrderedDict()  # cached, no request: evicted first-in first
        self.num_encoded = 0  # images encoded since start (the test's counter, and a metric)
        self.num_reused = 0  # references served from the buffer without encoding

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self.rows

    def reference(self, mm_hash: str, req_id: str) -> None:
        """``req_id`` uses the cached image ``mm_hash`` (encoded earlier, or this step
        for another request: either way not encoded for it)."""
        users = self.refs.setdefault(mm_hash, set())
        if req_id not in users:
            if not users:
                self.unreferenced.pop(mm_hash, None)
            users.add(req_id)
            self.num_reused += 1

    def can_allocate(self, length: int) -> bool:
        """Rows for an image of ``length`` tokens are free or can be freed."""
        held = sum(len(self.rows[h]) for h in self.unreferenced)
        return length <= len(self.free_rows) + held

    def allocate(self, mm_hash: str, length: int, req_id: str) -> list[int]:
        """Rows for an image to encode this step (evicting unreferenced images, oldest
        first); the caller has checked can_allocate."""
        while len(self.free_rows) < length:
            old, _ = self.unreferenced.popitem(last=False)
            self.free_rows.extend(reversed(self.rows.pop(old)))
            self.refs.pop(old, None)
        rows = [self.free_rows.pop() for _ in range(length)]
        self.rows[mm_hash] = rows
        self.refs[mm_hash] = {req_id}
        self.num_encoded += 1
        return rows

    def release(self, mm_hash: str, req_id: str) -> None:
        """``req_id`` no longer needs ``mm_hash`` (its tokens are computed, or it ended)."""
        users = self.refs.get(mm_hash)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        if not users and mm_hash in self.rows:
            self.unreferenced[mm_hash] = None

    def drop(self, mm_hash: str) -> None:
        """Forget an image that was given rows but will not be encoded (its only request
        was preempted in the same schedule): its rows are free again."""
        self.free_rows.extend(reversed(self.rows.pop(mm_hash)))
        self.refs.pop(mm_hash, None)
        self.unreferenced.pop(mm_hash, None)
        self.num_encoded -= 1

    def release_all(self, req_id: str, hashes) -> None:
        for h in hashes:
            self.release(h, req_id)
