"""EngineCore: the step loop body — schedule, execute on the device, update."""
from __future__ import annotations

import logging

from jaxserve.config import EngineConfig
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
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.model_runner.num_blocks)
        self.num_steps = 0  # steps that ran the model

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Requests a stop string ended (found by the detokenizer)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if (scheduler_output.total_num_scheduled_tokens == 0 and not scheduler_output.finished_req_ids
                and not scheduler_output.preempted_req_ids):
            return []  # nothing for the runner to run or to forget
        runner_output = self.model_runner.execute_model(scheduler_output)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)
