"""EngineCore: the step loop body — schedule, execute on the device, update.

With data parallelism there is one scheduler (and KV block pool) per rank; a new
request goes to one rank (core/sched/dp_balancer.py) and stays there, and one
runner step serves every rank's scheduler output at once.
"""
from __future__ import annotations

import dataclasses
import logging

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import PrefixCacheStats
from jaxserve.core.sched.dp_balancer import choose_rank
from jaxserve.core.sched.scheduler import Scheduler, SchedulerStats
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")


class EngineCore:
    def __init__(self, config: EngineConfig, model_path: str, *, progress: bool = True) -> None:
        self.config = config
        self.model_runner = ModelRunner(config, model_path, progress=progress)
        self.warmup_seconds = 0.0
        if not config.enforce_eager:
            self.warmup_seconds = self.model_runner.warmup()
        self.schedulers = [
            Scheduler(config.scheduler_config, config.cache_config, self.model_runner.num_blocks)
            for _ in range(config.parallel_config.data_parallel_size)
        ]
        self._rank_of: dict[str, int] = {}  # unfinished request id -> its rank
        self.num_steps = 0  # steps that ran the model
        # Called with each step's scheduler outputs before the runner runs them
        # (multi-host: the leader broadcasts them to the followers).
        self.on_schedule = None

    @property
    def scheduler(self) -> Scheduler:
        """Rank 0's scheduler (the only one without data parallelism)."""
        return self.schedulers[0]

    def add_request(self, request: Request) -> None:
        rank = choose_rank(self.schedulers, request)
        self.schedulers[rank].add_request(request)
        self._rank_of[request.request_id] = rank

    def has_request(self, request_id: str) -> bool:
        return request_id in self._rank_of

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._rank_of.pop(rid, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, rids in by_rank.items():
            self.schedulers[rank].finish_requests(rids, status)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Requests a stop string ended (found by the detokenizer)."""
        self._finish(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return any(s.has_requests() for s in self.schedulers)

    def make_rank_stats(self) -> list[SchedulerStats]:
        """Each rank's stats (prefix-cache counters since the last call)."""
        return [s.make_stats() for s in self.schedulers]

    def make_stats(self) -> SchedulerStats:
        """All ranks together: counts summed, KV usage the mean (ranks are equal size)."""
        return combine_stats(self.make_rank_stats())

    def step(self) -> list[EngineCoreOutput]:
        outputs = [s.schedule() for s in self.schedulers]
        if not any(so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids for so in outputs):
            return []  # nothing for the runner to run or to forget
        if self.on_schedule is not None:
            self.on_schedule(outputs)
        runner_outputs = self.model_runner.execute_model(outputs)
        self.num_steps += 1
        results: list[EngineCoreOutput] = []
        for sched, so, ro in zip(self.schedulers, outputs, runner_outputs):
            results += sched.update_from_output(so, ro)
        for out in results:
            if out.finished:
                self._rank_of.pop(out.request_id, None)
        return results


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    if len(stats) == 1:
        return stats[0]
    counters = {f.name: sum(getattr(s.prefix_cache_stats, f.name) for s in stats)
                for f in dataclasses.fields(PrefixCacheStats) if f.name != "reset"}
    pcs = PrefixCacheStats(**counters, reset=any(s.prefix_cache_stats.reset for s in stats))
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats), num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats), prefix_cache_stats=pcs,
        num_preemptions=sum(s.num_preemptions for s in stats))
