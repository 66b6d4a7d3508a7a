"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival))."""
from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from typing import Iterator


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque = deque()

    def add_request(self, request) -> None:
        self._q.append(request)

    def prepend_request(self, request) -> None:
        # A preempted request goes back to the front: it was admitted before the others.
        self._q.appendleft(request)

    def peek_request(self):
        return self._q[0]

    def pop_request(self):
        return self._q.popleft()

    def remove_request(self, request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator:
        return iter(self._q)


class PriorityRequestQueue:
    """Lower (priority, arrival_time) first; ties broken by insertion order."""

    def __init__(self) -> None:
        self._heap: list = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # ids of entries removed lazily
        self._size = 0

    def add_request(self, request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        self._size += 1

    prepend_request = add_request  # position is decided by priority anyway

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek_request(self):
        self._drop_removed()
        return self._heap[0][3]

    def pop_request(self):
        self._drop_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[3]

    def remove_request(self, request) -> None:
        if not any(e[3] is request for e in self._heap if id(e[3]) not in self._removed):
            raise ValueError(f"{request} is not in the queue")
        self._removed.add(id(request))
        self._size -= 1

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator:
        live = [e for e in self._heap if id(e[3]) not in self._removed]
        return (e[3] for e in sorted(live, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy):
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
