"""Which data-parallel rank a new request goes to (docs/design.md §5).

Each rank has its own scheduler and KV cache, so a request's cost on a rank is the
work already queued there plus the prompt tokens it would compute there: tokens
that rank's prefix cache already holds are free. Lowest cost wins; ties go to the
lower rank. (vLLM's DP balancer weighs waiting and running request counts;
counting tokens keeps one long prompt from looking like one short one, and the
prefix term sends shared-prefix requests where their KV already is, as long as
that rank is not busier by more than the tokens saved.)
"""
from __future__ import annotations

from typing import Sequence

from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.request import Request


def rank_load(scheduler: Scheduler) -> int:
    """Tokens held or queued on a rank: every unfinished request's context."""
    return sum(r.num_tokens for r in scheduler.requests.values())


def choose_rank(schedulers: Sequence[Scheduler], request: Request) -> int:
    """The rank with the lowest load + uncached prompt tokens."""
    if len(schedulers) == 1:
        return 0
    best, best_cost = 0, None
    for rank, sched in enumerate(schedulers):
        _, num_cached = sched.kv_cache_manager.get_computed_blocks(request)
        cost = (rank_load(sched) + request.num_tokens - num_cached, rank)
        if best_cost is None or cost < best_cost:
            best, best_cost = rank, cost
    return best
