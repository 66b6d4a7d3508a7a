"""Scheduler: decides each step which requests run and how many tokens each computes.

There is no prefill or decode phase: every request has ``num_computed_tokens``
catching up with ``num_tokens``. One token budget per step is shared by running
requests (served first, in order) and then waiting ones. This one rule gives
chunked prefill, continuous batching and prefix-cache skips.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.core.encoder_cache_manager import EncoderCacheManager
from jaxserve.core.kv_cache_groups import KVCacheLayout
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, cdiv, get_request_block_hasher
from jaxserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.core.sched.request_queue import SchedulingPolicy, create_request_queue
from jaxserve.core.sched.spec_budget import SpecDecodeBudget
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.structured_output import StructuredOutputManager

logger = logging.getLogger("jaxserve")


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters (vLLM's names). A draft is one request's draft
    tokens in one step; ``num_accepted_tokens_per_pos[i]``: drafts whose token i was
    accepted. Mean acceptance length = 1 + num_accepted_tokens / num_drafts."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    @classmethod
    def merged(cls, stats: "list[SpecDecodingStats]") -> "SpecDecodingStats":
        """A new counter holding the sum of ``stats`` (data-parallel ranks)."""
        total = cls(stats[0].num_spec_tokens)
        for s in stats:
            total.add(s)
        return total

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def summary(self) -> dict:
        """vLLM's derived figures: acceptance rate (accepted / drafted tokens), mean
        acceptance length (1 + accepted / drafts: the tokens a verified draft yields),
        and per position i the fraction of drafts whose token i was accepted."""
        drafts = max(self.num_drafts, 1)
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts,
            "acceptance_rate_per_pos": [n / drafts for n in self.num_accepted_tokens_per_pos],
        }

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None  # since the last make_stats(); None without speculation
    # LoRA: adapter name -> its running / waiting requests (vLLM's lora_requests_info);
    # max_loras 0 when LoRA is off.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0


def _count_adapters(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        *,
        check_invariants: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        token_bucket=None,
        kv_cache_layout: KVCacheLayout | None = None,
        max_loras: int = 0,
    ) -> None:
        """token_bucket: the runner's padded token count for a count (speculative
        decoding weighs drafts by the measured time of the bucket they lead to).
        kv_cache_layout: the runner's KV cache groups; blocks behind a sliding-window
        group's window are given back (KVCacheManager). None: one full-attention group.
        max_loras: with LoRA, the most distinct adapters among running requests (the
        runner's device slots); 0: LoRA off."""
        self.scheduler_config = scheduler_config
        self.speculative_config = speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        # A draft model writes KV up to k positions past a request's scheduled tokens (its
        # own guesses), and keeps its last token's: blocks for both (see free_tail below).
        draft_model = speculative_config is not None and speculative_config.method == "draft_model"
        self.num_lookahead_tokens = self.num_spec_tokens if draft_model else 0
        self.spec_budget = (SpecDecodeBudget(token_bucket)
                            if speculative_config is not None and speculative_config.adaptive_drafts else None)
        # Since the last make_stats() (for stat loggers), and since start (offline metrics).
        self.spec_stats = SpecDecodingStats(self.num_spec_tokens)
        self.spec_stats_total = SpecDecodingStats(self.num_spec_tokens)
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        # Schedule step N + 1 while step N runs (EngineCore): running requests count
        # the tokens in flight (Request.num_output_placeholders).
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks, self.block_size, self.max_model_len, cache_config.enable_prefix_caching,
            layout=kv_cache_layout,
        )
        # Hashes are only needed with prefix caching; computing them is not free.
        self.block_hasher = get_request_block_hasher(self.block_size) if cache_config.enable_prefix_caching else None
        # Images: the encoder-output buffer's rows, and this step's encodes (mm_hash ->
        # (feature, rows)), which the runner runs before the model step.
        self.encoder_cache = EncoderCacheManager(scheduler_config.encoder_cache_rows)
        self.encoder_budget = scheduler_config.encoder_budget
        self._step_encodes: dict = {}
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): sent to the runner so it drops their state.
        self.finished_req_ids: set[str] = set()
        # False while the engine holds new work (paused, asleep, a weight update waiting
        # for the running requests to finish): waiting requests stay in the queue.
        self.admit_waiting = True
        self.max_loras = max_loras
        self.num_preemptions = 0
        self.check_invariants = check_invariants
        self.structured_output_manager = structured_output_manager
        # Outputs of requests that ended inside schedule() (a grammar that failed to
        # compile), handed to the engine by take_pending_outputs().
        self._pending_outputs: list[EngineCoreOutput] = []

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.num_tokens >= self.max_model_len + 1 or request.num_tokens == 0:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens does not fit max_model_len={self.max_model_len}"
            )
        if self.block_hasher is not None and request._block_hasher is None:
            request._block_hasher = self.block_hasher
            request.update_block_hashes()
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: str | list[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string found by the detokenizer)."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        self._release_encoder_inputs(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_block_ids: dict[str, tuple[list[int], ...]] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        encoder_budget = self.encoder_budget
        self._step_encodes = {}

        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        sc = self.speculative_config
        if sc is not None and sc.disable_by_batch_size is not None and len(self.running) > sc.disable_by_batch_size:
            for request in self.running:  # a big batch gains nothing from speculation
                request.spec_token_ids = []
        if self.spec_budget is not None:
            drafting = [r for r in self.running if r.spec_token_ids]
            if drafting:
                remaining = [r.num_tokens - r.num_computed_tokens for r in self.running]
                self.spec_budget.plan(drafting, min(sum(remaining), self.max_num_scheduled_tokens),
                                      sum(1 for n in remaining if n == 1))

        # 1. Running requests, in order. Each needs its remaining tokens (1 when decoding)
        # plus its draft tokens, if it has any (speculative decoding).
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if request.num_output_placeholders and self._last_output_in_flight(request):
                req_index += 1  # the step in flight samples its last token
                continue
            num_new_tokens = self._clamp_long_prefill(
                request.num_tokens + request.num_output_placeholders + len(request.spec_token_ids)
                - request.num_computed_tokens)
            num_new_tokens = min(num_new_tokens, token_budget)
            # Never compute a position at or past max_model_len.
            num_new_tokens = min(num_new_tokens, self.max_model_len - request.num_computed_tokens)
            if request.mm is not None:
                num_new_tokens, to_encode = self._plan_encoder_inputs(request, request.num_computed_tokens,
                                                                      num_new_tokens, encoder_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue

            new_blocks, num_undone_reqs, num_undone_tokens = self._allocate_or_preempt(
                request, num_new_tokens, scheduled_running_reqs, num_scheduled_tokens, req_to_new_block_ids,
                preempted_reqs, scheduled_spec_decode_tokens,
            )
            # Each undone victim sat before this request in self.running.
            req_index -= num_undone_reqs
            token_budget += num_undone_tokens
            if new_blocks is None:  # the request preempted itself: nothing else fits
                break

            scheduled_running_reqs.append(request)
            if request.mm is not None:
                encoder_budget -= self._commit_encoder_inputs(request, request.num_computed_tokens, num_new_tokens,
                                                              to_encode)
            req_to_new_block_ids[request.request_id] = tuple([b.block_id for b in g] for g in new_blocks)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                # The drafts that fit (the budget or max_model_len may cut them short).
                num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []

        # 2. Waiting requests, in queue order, unless this step had to preempt. Those
        # whose grammar is still compiling are passed over (and keep their place).
        skipped_waiting: list[Request] = []
        # LoRA: the adapters of the running requests (at most max_loras: the runner's
        # slots). A request of another adapter waits while they are all taken, as in
        # vLLM, and base-model requests behind it still go; unlike vLLM, LoRA requests
        # behind it wait too (first come, first served among adapters' requests), so
        # the running adapters drain and a waiting adapter is never starved by a steady
        # stream of requests for the running ones.
        running_loras = ({r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                         if self.max_loras else set())
        lora_blocked = False
        if not preempted_reqs and self.admit_waiting:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting.peek_request()
                if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                    self.waiting.pop_request()
                    if not request.is_finished():  # else its grammar failed: it ended
                        skipped_waiting.append(request)
                    continue
                lora = request.lora_request
                if lora is not None and self.max_loras and (
                        lora_blocked or (lora.lora_int_id not in running_loras
                                         and len(running_loras) >= self.max_loras)):
                    lora_blocked = True
                    self.waiting.pop_request()
                    skipped_waiting.append(request)
                    continue
                computed_blocks, num_new_local_computed = self.kv_cache_manager.get_computed_blocks(request)
                num_computed_tokens = num_new_local_computed
                num_new_tokens = self._clamp_long_prefill(request.num_tokens - num_computed_tokens)
                if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > token_budget:
                    break  # FCFS: do not skip the blocked request
                num_new_tokens = min(num_new_tokens, token_budget)
                assert num_new_tokens > 0
                if request.mm is not None:
                    num_new_tokens, to_encode = self._plan_encoder_inputs(request, num_computed_tokens,
                                                                          num_new_tokens, encoder_budget)
                    if num_new_tokens <= 0:
                        break  # FCFS: its image waits for room in the encoder budget / buffer
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_new_local_computed, computed_blocks,
                    num_lookahead_tokens=self.num_lookahead_tokens,
                )
                if new_blocks is None:
                    break
                if request.mm is not None:
                    encoder_budget -= self._commit_encoder_inputs(request, num_computed_tokens, num_new_tokens,
                                                                  to_encode)
                self.waiting.pop_request()
                self.running.append(request)
                if lora is not None:
                    running_loras.add(lora.lora_int_id)
                self.kv_cache_manager.record_prefix_cache_hit(request, num_computed_tokens)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                else:
                    assert request.status == RequestStatus.PREEMPTED
                    scheduled_resumed_reqs.append(request)
                req_to_new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed_tokens
                if request.scheduled_time is None:
                    request.scheduled_time = time.monotonic()
        for request in reversed(skipped_waiting):
            self.waiting.prepend_request(request)

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        new_reqs_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=req_to_new_block_ids[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                mm=r.mm,
            )
            for r in scheduled_new_reqs
        ]
        cached = CachedRequestData()
        for r in scheduled_running_reqs + scheduled_resumed_reqs:
            cached.req_ids.append(r.request_id)
            cached.resumed_from_preemption.append(r in scheduled_resumed_reqs)
            cached.new_block_ids.append(req_to_new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)

        structured_ids, bitmask = self._grammar_bitmask(num_scheduled_tokens)
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted_reqs},
            structured_output_request_ids=structured_ids,
            grammar_bitmask=bitmask,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            scheduled_encoder_inputs=self._step_encodes,
            encoder_rows=self._encoder_rows(num_scheduled_tokens),
        )
        self._step_encodes = {}
        # A request's computed count advances as soon as it is scheduled: its KV is
        # written by this step, and the next schedule() may run before the output is back.
        for req_id, n in num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.mm is not None:
                # Images whose tokens are all computed now: their rows stay cached (for
                # another request or turn) but may be reused from the next step on.
                self.encoder_cache.release_all(req_id, [f.mm_hash for f in request.mm.features
                                                        if f.end <= request.num_computed_tokens])
            # Async scheduling: a request whose tokens this step reaches samples one, which
            # the next schedule() counts as there before the output is back.
            in_flight = request.num_tokens + request.num_output_placeholders
            if self.async_scheduling and request.num_computed_tokens >= in_flight:
                request.num_output_placeholders += 1
        self.finished_req_ids = set()
        if self.check_invariants:
            self.assert_invariants()
        return scheduler_output

    def _last_output_in_flight(self, request: Request) -> bool:
        """Async scheduling: the tokens in flight end the request by length (max_tokens
        or max_model_len), so scheduling it again would only compute a token to drop."""
        num_tokens = request.num_tokens + request.num_output_placeholders
        return num_tokens >= self.max_model_len or (
            request.max_tokens is not None
            and request.num_output_tokens + request.num_output_placeholders >= request.max_tokens)

    def _grammar_ready(self, request: Request) -> bool:
        """A WAITING_FOR_FSM request whose grammar is compiled becomes WAITING. One whose
        compile failed ends here (aborted, its output queued for take_pending_outputs)."""
        so = request.structured_output_request
        if not so.is_ready():
            return False
        if so.error is not None:
            logger.error("request %s: its grammar failed to compile: %r", request.request_id, so.error)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._pending_outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                error=f"structured output grammar failed to compile: {so.error!r}", error_is_client=True))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _grammar_bitmask(self, num_scheduled_tokens: dict[str, int]) -> tuple[list[str], object]:
        """The constrained requests that sample this step, and their packed next-token
        masks ([n, ceil(V/32)] int32; None when there are none)."""
        manager = self.structured_output_manager
        if manager is None:
            return [], None
        reqs = []
        for req_id, n in num_scheduled_tokens.items():
            r = self.requests[req_id]
            # (num_computed_tokens still excludes this step's tokens here.)
            if manager.is_constrained(r) and r.num_computed_tokens + n >= r.num_tokens:
                reqs.append(r)
        if not reqs:
            return [], None
        return [r.request_id for r in reqs], manager.grammar_bitmask(reqs)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended inside schedule() (see _grammar_ready)."""
        out, self._pending_outputs = self._pending_outputs, []
        return out

    # ------------------------------------------------------------------ images
    def _plan_encoder_inputs(self, request: Request, num_computed: int, num_new_tokens: int,
                             encoder_budget: int) -> tuple[int, list]:
        """The images the tokens [num_computed, num_computed + num_new_tokens) need and
        that are not in the encoder cache (vLLM's _try_schedule_encoder_inputs): each
        must fit this step's encoder budget and the buffer, else the step stops before
        the image's first token (as it does before an image the chunk would end inside,
        with disable_chunked_mm_input). Returns (num_new_tokens, the images to encode); nothing
        is changed yet (_commit_encoder_inputs does it once the KV slots are there)."""
        to_encode, need = [], 0
        end = num_computed + num_new_tokens
        for f in request.mm.features:
            if f.offset >= end:
                break
            if self.scheduler_config.disable_chunked_mm_input and num_computed < f.end and end < f.end:
                # The chunk would end inside the image: stop before it (or wait for a step
                # with room for the rest of it, when it began in a prefix-cache hit).
                return max(f.offset - num_computed, 0), to_encode
            # Computed already, cached (or given rows this step for another request), or
            # earlier in this prompt.
            if f.end <= num_computed or self.encoder_cache.has(f.mm_hash) or any(
                    g.mm_hash == f.mm_hash for g in to_encode):
                continue
            if need + f.length > encoder_budget or not self.encoder_cache.can_allocate(need + f.length):
                return min(num_new_tokens, max(f.offset - num_computed, 0)), to_encode
            to_encode.append(f)
            need += f.length
        return num_new_tokens, to_encode

    def _commit_encoder_inputs(self, request: Request, num_computed: int, num_new_tokens: int,
                               to_encode: list) -> int:
        """Give rows to the images to encode this step, and reference every image the
        scheduled tokens reach. Returns the encoder tokens spent."""
        spent = 0
        for f in to_encode:
            rows = self.encoder_cache.allocate(f.mm_hash, f.length, request.request_id)
            self._step_encodes[f.mm_hash] = (f, rows)
            spent += f.length
        for f in request.mm.features:
            if f.offset < num_computed + num_new_tokens and f.end > num_computed:
                if f in to_encode:
                    continue
                self.encoder_cache.reference(f.mm_hash, request.request_id)
        return spent

    def _encoder_rows(self, num_scheduled_tokens: dict[str, int]) -> dict[str, list[int]]:
        """mm_hash -> its rows, for every image whose tokens this step computes."""
        out = {}
        for req_id, n in num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.mm is None:
                continue
            start = request.num_computed_tokens
            for f in request.mm.features:
                if f.offset < start + n and f.end > start:
                    out[f.mm_hash] = self.encoder_cache.rows[f.mm_hash]
        return out

    def _release_encoder_inputs(self, request: Request) -> None:
        """A request preempted or finished: its images lose this reference; one given
        rows earlier in this schedule that nobody else uses is not encoded after all."""
        if request.mm is None:
            return
        for f in request.mm.features:
            self.encoder_cache.release(f.mm_hash, request.request_id)
            if f.mm_hash in self._step_encodes and not self.encoder_cache.refs.get(f.mm_hash):
                del self._step_encodes[f.mm_hash]
                self.encoder_cache.drop(f.mm_hash)

    def _clamp_long_prefill(self, num_new_tokens: int) -> int:
        """At most ``long_prefill_token_threshold`` new tokens per request and step (0: no limit)."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            return threshold
        return num_new_tokens

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new_tokens: int,
        scheduled_running_reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
        req_to_new_block_ids: dict[str, tuple[list[int], ...]],
        preempted_reqs: list[Request],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> tuple[list[list[KVCacheBlock]] | None, int, int]:
        """Slots for a running request, preempting running requests until they fit.

        Out of blocks: preempt the lowest-priority request (the last added under FCFS)
        and retry; it will recompute from scratch (the prefix cache helps). A victim
        already scheduled in this step (possible under PRIORITY only) is taken out of
        the step's lists again. Returns (the new blocks, or None when ``request`` itself
        was preempted; how many scheduled requests were undone; their tokens).
        """
        num_undone_reqs = num_undone_tokens = 0
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                              num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks, num_undone_reqs, num_undone_tokens
            victim = self._pop_preemption_victim()
            if victim in scheduled_running_reqs:
                scheduled_running_reqs.remove(victim)
                num_undone_tokens += num_scheduled_tokens.pop(victim.request_id)
                req_to_new_block_ids.pop(victim.request_id)
                scheduled_spec_decode_tokens.pop(victim.request_id, None)
                num_undone_reqs += 1
            self._preempt_request(victim)
            preempted_reqs.append(victim)
            if victim is request:
                return None, num_undone_reqs, num_undone_tokens

    def _pop_preemption_victim(self) -> Request:
        """Take the request to preempt out of ``self.running``: the largest (priority,
        arrival_time) under PRIORITY, the last added under FCFS (never one scheduled
        earlier in the step: those come before the request being scheduled)."""
        if self.policy == SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        self._release_encoder_inputs(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token still in flight is appended when its step returns (update_from_output),
        # before the request can resume: it recomputes every token then.
        request.num_output_placeholders = 0
        request.spec_token_ids = []  # it resumes by recomputing; drafting starts again after
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    # ------------------------------------------------------------------ outputs
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules on token ids, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran: its tokens are dropped
            req_index = model_runner_output.req_id_to_index[req_id]
            new_token_ids = sampled[req_index]
            stopped = False
            # A request preempted after this step was scheduled (possible once scheduling
            # runs ahead of outputs) sits in the waiting queue, not in running.
            was_preempted = request.status == RequestStatus.PREEMPTED
            error = None
            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if spec and new_token_ids and not was_preempted:
                self._roll_back_rejected(request, len(spec), len(new_token_ids) - 1)
            if new_token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1  # async scheduling: its token is back
            if new_token_ids:
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
                if not stopped and request.structured_output_request is not None:
                    try:
                        stopped = self._advance_grammar(request, new_token_ids)
                    except Exception as e:  # noqa: BLE001 — one request's grammar, not the engine
                        logger.exception("request %s: its grammar failed", req_id)
                        request.status = RequestStatus.FINISHED_ABORTED
                        stopped, error = True, f"structured output grammar failed: {e!r}"
            new_logprobs = None
            if logprobs is not None and new_token_ids and request.sampling_params.logprobs is not None:
                # Row of this request's j-th new token: req_index * stride + j.
                start = req_index * model_runner_output.logprobs_stride
                new_logprobs = logprobs.slice(start, start + len(new_token_ids))
            new_prompt_logprobs = model_runner_output.prompt_logprobs_dict.get(req_id)
            pooled = model_runner_output.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request ends with its prompt
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            if stopped:
                if was_preempted:
                    self.waiting.remove_request(request)
                else:
                    self.running.remove(request)
                self._free_request(request)
            else:
                if self.num_lookahead_tokens and not was_preempted:
                    # Between steps a request holds the blocks of its computed tokens and of
                    # the one after (the draft model fed it); the lookahead goes back. The
                    # runner keeps the same count (ModelRunner._blocks_past_computed).
                    self.kv_cache_manager.free_tail(request, request.num_computed_tokens + 1)
                drafts = model_runner_output.draft_token_ids.get(req_id) if new_token_ids else None
                if drafts and self._may_speculate(request):
                    request.spec_token_ids = drafts
            if new_token_ids or new_prompt_logprobs is not None or stopped:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=new_prompt_logprobs,
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        error=error,
                        pooling_output=pooled,
                        scheduled_time=request.scheduled_time,
                    )
                )
        if self.check_invariants:
            self.assert_invariants()
        return outputs

    def _roll_back_rejected(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Speculative decoding: the step computed the request's last token and its
        ``num_draft`` drafts; only ``num_accepted`` drafts held. The rejected positions
        are uncomputed again and the blocks held only for them go back to the pool
        (never hashed: hashes cover committed tokens only)."""
        num_rejected = num_draft - num_accepted
        request.num_computed_tokens -= num_rejected
        if num_rejected:
            self.kv_cache_manager.free_tail(request, request.num_computed_tokens + (self.num_lookahead_tokens > 0))
        self.spec_stats.observe_draft(num_draft, num_accepted)
        self.spec_stats_total.observe_draft(num_draft, num_accepted)
        # Decayed counts: roughly the last acceptance_window draft tokens.
        request.num_spec_drafted += num_draft
        request.num_spec_accepted += num_accepted
        sc = self.speculative_config
        if request.num_spec_drafted >= sc.acceptance_window:
            if request.num_spec_accepted < sc.min_acceptance * request.num_spec_drafted:
                request.spec_disabled = True
            request.num_spec_drafted /= 2
            request.num_spec_accepted /= 2

    def _may_speculate(self, request: Request) -> bool:
        """Drafts are verified exactly only where every position samples like the first:
        not for a constrained request (its grammar advances token by token), one with
        penalties (they depend on the drafts before each position), or one still held
        below min_tokens (its stop-token mask may lift inside the run), or one with bad
        words (a multi-token word's ban depends on the tokens before each position); nor
        where speculation has not paid (min_acceptance). logit_bias and allowed_token_ids
        are the same at every position: verified exactly."""
        sp = request.sampling_params
        return not (request.spec_disabled or request.structured_output_request is not None or sp.bad_words
                    or request.num_output_tokens < sp.min_tokens or sp.presence_penalty != 0
                    or sp.frequency_penalty != 0 or sp.repetition_penalty != 1)

    def _advance_grammar(self, request: Request, new_token_ids: list[int]) -> bool:
        """Feed the sampled tokens to the request's grammar; True when that ends the
        request (the constrained output is complete, or a token broke the grammar)."""
        if not self.structured_output_manager.should_advance(request):
            return False
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens(new_token_ids):
            # Only a masked-out token gets here (the sampler never draws one).
            logger.warning("request %s: token(s) %s rejected by its grammar; stopping it", request.request_id,
                           new_token_ids)
        elif not grammar.is_terminated():
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    def _update_request_with_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        stopped = False
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            stopped = check_stop(request, self.max_model_len)
            if stopped:
                # Tokens after the stop are dropped.
                del new_token_ids[num_new:]
                break
        return new_token_ids, stopped

    # ------------------------------------------------------------------ stats / checks
    def make_stats(self) -> SchedulerStats:
        spec_stats = None
        if self.speculative_config is not None:
            spec_stats = self.spec_stats
            self.spec_stats = SpecDecodingStats(self.num_spec_tokens)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=spec_stats,
            running_lora_adapters=_count_adapters(self.running) if self.max_loras else {},
            waiting_lora_adapters=_count_adapters(self.waiting) if self.max_loras else {},
            max_loras=self.max_loras,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def assert_invariants(self) -> None:
        """Block accounting must add up after every step."""
        pool = self.kv_cache_manager.block_pool
        refs = [0] * pool.num_gpu_blocks
        for req_id, lists in self.kv_cache_manager.req_to_blocks.items():
            assert req_id in self.requests, f"blocks held by unknown request {req_id}"
            assert len({len(blocks) for blocks in lists}) == 1, "groups' block lists differ in length"
            for blocks in lists:
                for b in blocks:
                    refs[b.block_id] += 1
        free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        assert len(free_ids) == pool.get_num_free_blocks()
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], f"{b}: {refs[b.block_id]} holders"
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"{b} free-queue mismatch"
        assert 0 not in free_ids, "the null block must never be free"
        for h, bucket in pool.cached_block_hash_to_block.items():
            for b in bucket.values():
                assert b.block_hash == h
        running = set(id(r) for r in self.running)
        waiting = set(id(r) for r in self.waiting)
        assert not running & waiting
        assert len(running) + len(waiting) == len(self.requests)
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            # Past num_tokens only by the draft tokens of the step just scheduled.
            assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders + self.num_spec_tokens
            need = cdiv(min(r.num_computed_tokens, self.max_model_len), self.block_size)
            assert self.kv_cache_manager.num_blocks(r.request_id) >= need
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED)
            assert r.request_id not in self.kv_cache_manager.req_to_blocks


def check_stop(request: Request, max_model_len: int) -> bool:
    """Stop rules on token ids (stop *strings* are matched on text by the detokenizer)."""
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    sp = request.sampling_params
    if request.num_output_tokens < sp.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not sp.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in sp.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False
