"""EngineCore: the step loop body — schedule, execute on the device, update.

With data parallelism there is one scheduler (and KV block pool) per rank; a new
request goes to one rank (core/sched/dp_balancer.py) and stays there, and one
runner step serves every rank's scheduler output at once.

Multi-host (jaxserve/distributed/): every process builds the same runner and warms
up the same programs; process 0 (the leader) then schedules and publishes each
step's scheduler outputs before running them, and the other processes (followers)
only replay them: ``EngineCore(...)`` on a follower serves the leader's steps until
the leader shuts down, then ends the process (SystemExit(0)), so one script runs
unchanged on every process.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import PrefixCacheStats
from jaxserve.core.sched.dp_balancer import choose_rank
from jaxserve.core.sched.scheduler import Scheduler, SchedulerStats, SpecDecodingStats
from jaxserve.distributed.cluster import initialize_distributed, is_leader, is_multihost
from jaxserve.distributed.step_channel import StepChannel, run_follower
from jaxserve.engine.fault_injection import FaultInjector
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.structured_output import StructuredOutputManager

logger = logging.getLogger("jaxserve")


def pause_mode(mode: str, wait_for_inflight_requests: bool | None = None) -> str:
    """pause_generation's mode, "abort" or "wait" (vLLM's ``wait_for_inflight_requests``
    picks it when given); ValueError otherwise."""
    if wait_for_inflight_requests is not None:
        return "wait" if wait_for_inflight_requests else "abort"
    if mode not in ("wait", "abort"):
        raise ValueError(f"mode: 'abort' or 'wait', got {mode!r}")
    return mode


@dataclasses.dataclass(frozen=True)
class RunnerCall:
    """A leader -> follower message besides the steps (multi-host): a ModelRunner
    method (update_weights, sleep, wake_up) for every process to replay in order."""

    method: str
    args: tuple = ()


class EngineCore:
    def __init__(self, config: EngineConfig, model_path: str, *, progress: bool = True) -> None:
        self.config = config
        pc = config.parallel_config
        # Before anything touches a device: joins the other processes when this is a
        # multi-host run (flags, or a TPU pod / launcher environment); else nothing.
        initialize_distributed(pc.distributed_coordinator_address, pc.num_processes, pc.process_id)
        self._channel: StepChannel | None = None
        try:
            self.model_runner = ModelRunner(config, model_path, progress=progress)
            self.warmup_seconds = 0.0
            if not config.enforce_eager:
                self.warmup_seconds = self.model_runner.warmup(background=config.background_warmup)
            if is_multihost():
                self._channel = StepChannel()
        except Exception:
            if not is_multihost():
                raise
            # A process that fails while starting must not linger: JAX's exit hook would
            # wait in its shutdown barrier while the others wait for this process, until
            # a timeout of minutes. Gone at once, the others' heartbeat checks end them.
            logger.exception("process %d failed while starting; ending it", jax.process_index())
            logging.shutdown()
            os._exit(1)
        if self._channel is not None:
            if not is_leader():
                steps = run_follower(self._follow, self._channel)
                logger.info("follower %d: the leader shut down after %d steps", jax.process_index(), steps)
                raise SystemExit(0)
            atexit.register(self.shutdown)
        self.schedulers = [
            Scheduler(config.scheduler_config, config.cache_config, self.model_runner.num_blocks,
                      speculative_config=config.speculative_config, token_bucket=self.model_runner.token_buckets,
                      kv_cache_layout=self.model_runner.kv_cache_layout,
                      max_loras=config.lora_config.max_loras if config.lora_config is not None else 0)
            for _ in range(pc.data_parallel_size)
        ]
        self.num_steps = 0  # steps that ran the model
        # Async scheduling: (scheduler outputs, InflightStep) of the step the device runs.
        self._inflight = None
        self.structured_output_manager: StructuredOutputManager | None = None
        self.fault_injector: FaultInjector | None = None  # tests and drills (engine/fault_injection.py)
        # Why new requests wait now ("pause", "sleep", "update"): the schedulers admit
        # none while any holds (running requests go on).
        self._holds: set[str] = set()

    def _follow(self, message) -> None:
        """A follower's handling of one leader message: a step, or a runner call. A
        runner call that fails fails on the leader too, with the same checks and the
        same error for its caller; the follower logs it and goes on, as the leader does."""
        if not isinstance(message, RunnerCall):
            self.model_runner.execute_model(message)
            return
        try:
            getattr(self.model_runner, message.method)(*message.args)
        except Exception:  # noqa: BLE001 — the leader reports it
            logger.exception("follower %d: %s failed", jax.process_index(), message.method)

    # ------------------------------------------------------------------ holds, weights, sleep (docs/research_loop.md)
    def hold(self, reason: str) -> None:
        """Admit no new request until ``release(reason)`` (running ones go on)."""
        self._holds.add(reason)
        self._set_admission()

    def release(self, reason: str) -> None:
        self._holds.discard(reason)
        self._set_admission()

    def _set_admission(self) -> None:
        for sched in self.schedulers:
            sched.admit_waiting = not self._holds

    @property
    def is_paused(self) -> bool:
        return "pause" in self._holds

    def num_running(self) -> int:
        """Requests holding KV (scheduled at least once and not finished or preempted)."""
        return sum(len(s.running) for s in self.schedulers)

    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers)

    def is_idle(self) -> bool:
        """No request holds KV and no step is in flight: the weights and the KV cache may change."""
        return self._inflight is None and self.num_running() == 0

    def _require_idle(self, what: str) -> None:
        if not self.is_idle():
            raise RuntimeError(f"{what}: {self.num_running()} request(s) are running; pause generation first "
                               f"(pause_generation(mode='wait' or 'abort')) or let them finish")

    def _replay(self, method: str, *args) -> None:
        if self._channel is not None:
            self._channel.publish(RunnerCall(method, args))

    def update_weights(self, weights) -> dict:
        """New weights (runner/weight_update.py) between steps, with no request holding
        KV; the prefix cache is reset (its KV came from the old weights). Returns
        {"version", "num_params", "seconds", "source"}."""
        self._require_idle("update_weights")
        if self._channel is not None:
            from jaxserve.runner.weight_update import replayable

            weights = replayable(weights)
        self._replay("update_weights", weights)
        info = self.model_runner.update_weights(weights)
        self._reset_prefix_caches()
        return info

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's; False, nothing changed, while requests hold blocks)."""
        if not self.is_idle():
            return False
        return all([s.reset_prefix_cache() for s in self.schedulers])

    def _reset_prefix_caches(self) -> None:
        if not self.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset with no request running")

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 1) and the weights too (level 2) with no request
        running; new requests wait until wake_up(). Returns the bytes freed."""
        self._require_idle("sleep")
        self.model_runner.check_sleep(level)  # before the followers are told
        self._replay("sleep", level)
        freed = self.model_runner.sleep(level)
        self._reset_prefix_caches()  # the cached blocks' KV is gone
        self.hold("sleep")
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed (``tags``: "weights", "kv_cache"; None: both)."""
        self._replay("wake_up", tags)
        self.model_runner.wake_up(tags)
        if not self.model_runner.is_sleeping:
            self.release("sleep")

    @property
    def is_sleeping(self) -> bool:
        return self.model_runner.is_sleeping

    def attach_structured_output_manager(self, manager: StructuredOutputManager) -> None:
        """Grammar-constrained decoding (it needs the tokenizer, which the engine owns)."""
        self.structured_output_manager = manager
        for sched in self.schedulers:
            sched.structured_output_manager = manager

    def shutdown(self) -> None:
        """Multi-host: tell the followers to exit (0); stop a background warm-up.
        Idempotent; also run at exit."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            channel.close()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.model_runner.stop_warmup()

    @property
    def scheduler(self) -> Scheduler:
        """Rank 0's scheduler (the only one without data parallelism)."""
        return self.schedulers[0]

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora) -> bool:
        """Read and check a LoRA adapter (jaxserve/lora) unless it is loaded; True when it
        was read now. ValueError for a bad adapter, or when LoRA is off."""
        manager = self.model_runner.lora
        if manager is None:
            raise ValueError(f"Got lora_request {lora} but LoRA is not enabled! (start the engine with "
                             "enable_lora=True / --enable-lora)")
        return manager.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it keep it until they finish)."""
        manager = self.model_runner.lora
        return manager is not None and manager.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        manager = self.model_runner.lora
        return set() if manager is None else manager.list_loras()

    def add_request(self, request: Request) -> None:
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs: this engine has no structured output manager")
            self.structured_output_manager.grammar_init(request)
        self.schedulers[choose_rank(self.schedulers, request)].add_request(request)

    def has_request(self, request_id: str) -> bool:
        """Unfinished on some rank (each scheduler's ``requests`` is the truth)."""
        return any(request_id in s.requests for s in self.schedulers)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        for sched in self.schedulers:
            mine = [rid for rid in request_ids if rid in sched.requests]
            if mine:
                sched.finish_requests(mine, status)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Requests a stop string ended (found by the detokenizer)."""
        self._finish(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return self._inflight is not None or any(s.has_requests() for s in self.schedulers)

    def make_rank_stats(self) -> list[SchedulerStats]:
        """Each rank's stats (prefix-cache counters since the last call)."""
        return [s.make_stats() for s in self.schedulers]

    def make_stats(self) -> SchedulerStats:
        """All ranks together: counts summed, KV usage the mean (ranks are equal size)."""
        return combine_stats(self.make_rank_stats())

    def spec_decoding_totals(self) -> SpecDecodingStats | None:
        """Speculative decoding counters since start, all ranks together (None without it)."""
        if self.config.speculative_config is None:
            return None
        return SpecDecodingStats.merged([s.spec_stats_total for s in self.schedulers])

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run and update: the outputs of one step. With async scheduling, the
        outputs of the step before, while this one runs (see _step_async)."""
        if self.config.scheduler_config.async_scheduling:
            return self._step_async()
        outputs = self._schedule()
        # Requests that ended inside schedule() (a grammar that failed to compile).
        results: list[EngineCoreOutput] = [o for s in self.schedulers for o in s.take_pending_outputs()]
        if not self._has_step(outputs):
            return results  # nothing for the runner to run or to forget
        t0 = time.perf_counter()
        runner_outputs = self.model_runner.collect(self._dispatch(outputs))
        elapsed = time.perf_counter() - t0
        if self.config.speculative_config is not None:  # what drafts cost (spec_budget.py)
            num_tokens = max(so.total_num_scheduled_tokens for so in outputs)
            verified = any(so.scheduled_spec_decode_tokens for so in outputs)
            for sched in self.schedulers:
                if sched.spec_budget is not None:
                    sched.spec_budget.record(num_tokens, verified, elapsed)
        return results + self._update(outputs, runner_outputs)

    def _step_async(self) -> list[EngineCoreOutput]:
        """vLLM's async scheduling: schedule step N + 1 while step N runs (running
        requests count N's tokens as there: Request.num_output_placeholders), then fetch
        N's tokens into the input batch, start N + 1, and only then update the schedulers
        from N's outputs, so that this and the caller's output processing (detokenizing,
        streaming) run while the device computes N + 1. What the device waits for
        between two steps: N's bookkeeping and N + 1's inputs.

        A request that N ends (a stop token) may be in N + 1 too: that token is dropped
        (update_from_output skips finished requests) and its blocks are freed after N + 1
        was dispatched; the device runs the steps in order, so a later step that reuses
        them writes after N + 1. A grammar is advanced by N's tokens before N + 1's mask
        can be computed: while a constrained request is in the engine, steps run one at a
        time (the step in flight is finished first)."""
        # A constrained request came in while a step ran: that step finishes first.
        results: list[EngineCoreOutput] = (
            self._finish_inflight() if self._inflight is not None and self._needs_sync() else [])
        outputs = self._schedule()
        results += [o for s in self.schedulers for o in s.take_pending_outputs()]
        previous, self._inflight = self._inflight, None
        runner_outputs = self.model_runner.collect(previous[1]) if previous is not None else None
        if self._has_step(outputs):
            self._inflight = (outputs, self._dispatch(outputs))
            if self._needs_sync():  # this step's own tokens decide the next grammar mask
                results += self._finish_inflight()
        if previous is not None:
            results += self._update(previous[0], runner_outputs)
        return results

    def _schedule(self):
        """Every rank's SchedulerOutput, within the steps the runner has compiled (a
        background warm-up may not have reached the largest yet)."""
        budget = min(self.config.scheduler_config.max_num_batched_tokens, self.model_runner.ready_tokens)
        for sched in self.schedulers:
            sched.max_num_scheduled_tokens = budget
        return [s.schedule() for s in self.schedulers]

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        """Async scheduling: wait for the step in flight and apply its outputs."""
        outputs, inflight = self._inflight
        self._inflight = None
        return self._update(outputs, self.model_runner.collect(inflight))

    def _needs_sync(self) -> bool:
        """A grammar-constrained request is in the engine (async scheduling pauses)."""
        return self.structured_output_manager is not None and any(
            r.structured_output_request is not None for s in self.schedulers for r in s.requests.values())

    @staticmethod
    def _has_step(outputs) -> bool:
        return any(so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids for so in outputs)

    def _dispatch(self, outputs):
        """Start one step on the runner (published first to multi-host followers)."""
        if self.fault_injector is not None:
            self.fault_injector.before_step(self.num_steps + 1)
        if self._channel is not None:
            self._channel.publish(outputs)  # the followers run the same step
        inflight = self.model_runner.dispatch(outputs)
        self.num_steps += 1
        return inflight

    def _update(self, outputs, runner_outputs) -> list[EngineCoreOutput]:
        results: list[EngineCoreOutput] = []
        for sched, so, ro in zip(self.schedulers, outputs, runner_outputs):
            results += sched.update_from_output(so, ro)
        return results


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    if len(stats) == 1:
        return stats[0]
    counters = {f.name: sum(getattr(s.prefix_cache_stats, f.name) for s in stats)
                for f in dataclasses.fields(PrefixCacheStats) if f.name != "reset"}
    pcs = PrefixCacheStats(**counters, reset=any(s.prefix_cache_stats.reset for s in stats))
    spec = None
    if stats[0].spec_decoding_stats is not None:
        spec = SpecDecodingStats.merged([s.spec_decoding_stats for s in stats])
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats), num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats), prefix_cache_stats=pcs,
        num_preemptions=sum(s.num_preemptions for s in stats), spec_decoding_stats=spec)
