"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenized, stop strings,
logprobs as dicts, n > 1 completions gathered under their parent)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import (
    CompletionOutput, EngineCoreOutput, Logprob, LogprobsLists, PoolingOutput, PoolingRequestOutput,
    RequestFailedError, RequestOutput,
)
from jaxserve.pooling_params import PoolingParams, finalize
from jaxserve.request import FinishReason
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.fault_injection import FaultInjector
    from jaxserve.engine.request_stream import RequestStream
    from jaxserve.tracing import RequestTracer

logger = logging.getLogger("jaxserve")


@dataclass
class ParentRequest:
    """An n > 1 request: child i is engine request f"{i}_{request_id}"."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


@dataclass
class RequestState:
    request_id: str  # engine request id (the child id for n > 1)
    external_id: str
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_kind: RequestOutputKind
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float | None = None
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    stream: RequestStream | None = None  # AsyncLLM's per-request hand-over point; None for the offline LLM
    pooling_params: PoolingParams | None = None  # a pooling request's (resolved); None: generation
    # Tracing (jaxserve/tracing.py): the caller's trace context and what the span reports.
    trace_headers: dict[str, str] | None = None
    scheduled_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer, pooling_task: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.pooling_task = pooling_task  # the pooling model's "embed" / "classify"; None: generative
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.fault_injector: FaultInjector | None = None  # tests and drills
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint: a span per request as it ends

    def add_request(self, request_id: str, external_id: str, index: int, prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams, stream: RequestStream | None = None,
                    arrival_time: float | None = None, pooling_params: PoolingParams | None = None,
                    trace_headers: dict[str, str] | None = None) -> None:
        parent = None
        if params.n > 1:
            parent = self.parents.setdefault(external_id, ParentRequest(external_id, params.n))
        state = RequestState(
            request_id=request_id, external_id=external_id, index=index, parent=parent, prompt=prompt,
            prompt_token_ids=prompt_token_ids, params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
            output_kind=params.output_kind,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            stream=stream, pooling_params=pooling_params, trace_headers=trace_headers,
        )
        if arrival_time is not None:
            state.arrival_time = arrival_time
        self.request_states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        """Drop state of aborted requests; returns their final (abort) outputs."""
        outs = []
        for rid in list(request_ids):
            st = self.request_states.get(rid)
            if st is None:
                continue
            out = self._make_output(st, FinishReason.ABORT, None)
            if out is not None:
                outs.append((st, out))
            self._finish(st)
        return outs

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]):
        """Returns ([(state, RequestOutput | RequestFailedError)], request ids to abort in
        the engine core because a stop string ended them). A request whose output cannot
        be processed (its detokenizing raised) or that the core failed (eco.error) ends
        here with a RequestFailedError instead of an output; the others are unaffected.
        The caller aborts a failed request that the core still runs (``not eco.finished``)."""
        outputs = []
        reqs_to_abort = []
        now = time.monotonic()
        for eco in engine_core_outputs:
            st = self.request_states.get(eco.request_id)
            if st is None:
                continue
            if eco.scheduled_time is not None:
                st.scheduled_time = eco.scheduled_time
            try:
                if eco.error is not None:
                    raise RequestFailedError(st.external_id, eco.error, eco.error_is_client)
                self._process_one(st, eco, now, outputs, reqs_to_abort)
            except Exception as e:  # noqa: BLE001 — fail this request, keep serving the rest
                logger.exception("request %s failed while its output was processed", eco.request_id)
                if not isinstance(e, RequestFailedError):
                    e = RequestFailedError(st.external_id, repr(e))
                st.error = str(e)
                outputs.append((st, e))
                if st.parent is not None:
                    st.parent.finished.add(st.index)
                self._finish(st)
        return outputs, reqs_to_abort

    def _process_one(self, st: RequestState, eco: EngineCoreOutput, now: float, outputs: list,
                     reqs_to_abort: list) -> None:
        if st.pooling_params is not None:
            if eco.pooling_output is not None:
                data = finalize(eco.pooling_output, st.pooling_params, self.pooling_task)
                outputs.append((st, PoolingRequestOutput(st.external_id, PoolingOutput(data), st.prompt_token_ids,
                                                         True, eco.num_cached_tokens)))
                st.finish_reason, st.num_cached_tokens = "stop", eco.num_cached_tokens
            elif eco.finished:  # aborted
                outputs.append((st, self._make_output(st, eco.finish_reason, eco.stop_reason)))
            if eco.finished:
                self._finish(st)
            return
        if eco.new_token_ids and st.first_token_time is None:
            st.first_token_time = now
        st.num_cached_tokens = eco.num_cached_tokens
        if self.fault_injector is not None:
            self.fault_injector.before_detokenize(eco.new_token_ids)
        new_token_ids = eco.new_token_ids
        finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
        # The last token is an EOS / stop token (whose text is hidden), not the token that
        # completed a grammar (structured outputs), which is text like any other.
        stop_terminated = (finish_reason == FinishReason.STOP and bool(new_token_ids)
                           and new_token_ids[-1] in st.params.all_stop_token_ids)
        stop_str = st.detokenizer.update(new_token_ids, stop_terminated)
        if stop_str is not None:
            # Tokens after the one that completed the stop string (several tokens can
            # arrive at once with speculative decoding) are not part of the output.
            new_token_ids = new_token_ids[:st.detokenizer.num_tokens_used]
            if finish_reason is None:
                reqs_to_abort.append(eco.request_id)
            finish_reason, stop_reason = FinishReason.STOP, stop_str
        st.token_ids.extend(new_token_ids)
        if eco.new_logprobs is not None and st.logprobs is not None:
            self._append_logprobs(st, eco.new_logprobs, len(new_token_ids))
        if eco.new_prompt_logprobs is not None and st.prompt_logprobs is not None:
            st.prompt_logprobs.extend(self._logprob_dicts(
                eco.new_prompt_logprobs, st.params.prompt_logprobs, len(eco.new_prompt_logprobs.logprobs)))
        out = self._make_output(st, finish_reason, stop_reason)
        if out is not None:
            outputs.append((st, out))
        if finish_reason is not None:
            self._finish(st)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget requests without an output (their caller gets an error instead)."""
        for rid in request_ids:
            st = self.request_states.get(rid)
            if st is not None:
                if st.parent is not None:
                    st.parent.finished.add(st.index)
                self._finish(st)

    def _finish(self, st: RequestState) -> None:
        self.request_states.pop(st.request_id, None)
        if self.tracer is not None:
            self._trace(st)
        if st.parent is not None and len(st.parent.finished) == st.parent.n:
            self.parents.pop(st.parent.request_id, None)

    def _trace(self, st: RequestState) -> None:
        try:
            self.tracer.record(
                request_id=st.external_id, params=st.pooling_params or st.params, trace_headers=st.trace_headers,
                num_prompt_tokens=len(st.prompt_token_ids), num_generation_tokens=len(st.token_ids),
                num_cached_tokens=st.num_cached_tokens, arrival_time=st.arrival_time,
                scheduled_time=st.scheduled_time, first_token_time=st.first_token_time, end_time=time.monotonic(),
                finish_reason=st.finish_reason, error=st.error)
        except Exception:  # noqa: BLE001 — a tracing failure must not fail the request or the engine
            logger.exception("request %s: its trace span could not be recorded", st.external_id)

    def _logprob_dicts(self, lists: LogprobsLists, k: int, count: int) -> list[dict[int, Logprob]]:
        out = []
        decode = self.tokenizer.decode
        for row in range(count):
            ids = lists.logprob_token_ids[row]
            lps = lists.logprobs[row]
            d = {int(ids[0]): Logprob(float(lps[0]), int(lists.sampled_token_ranks[row]), decode([int(ids[0])]))}
            for j in range(1, min(k, len(ids) - 1) + 1):
                tid = int(ids[j])
                if tid not in d:
                    d[tid] = Logprob(float(lps[j]), j, decode([tid]))
            out.append(d)
        return out

    def _append_logprobs(self, st: RequestState, lists: LogprobsLists, count: int) -> None:
        dicts = self._logprob_dicts(lists, st.params.logprobs, count)
        for row, d in enumerate(dicts):
            st.cumulative_logprob += float(lists.logprobs[row][0])
        st.logprobs.extend(dicts)

    def _make_output(self, st: RequestState, finish_reason, stop_reason) -> RequestOutput | None:
        finished = finish_reason is not None
        delta = st.output_kind == RequestOutputKind.DELTA
        if st.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = st.detokenizer.get_next_output_text(finished, delta, st.sent_text_len)
        if delta:
            token_ids = st.token_ids[st.sent_tokens :]
            logprobs = st.logprobs[st.sent_logprobs :] if st.logprobs is not None else None
            if not finished and not token_ids and not text:
                return None
            st.sent_text_len += len(text)
            st.sent_tokens = len(st.token_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        else:
            token_ids, logprobs = list(st.token_ids), st.logprobs
        if finished:
            st.finish_reason = str(finish_reason)
        completion = CompletionOutput(
            index=st.index, text=text, token_ids=list(token_ids), cumulative_logprob=st.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=str(finish_reason) if finished else None, stop_reason=stop_reason if finished else None,
        )
        prompt_logprobs = st.prompt_logprobs
        if st.parent is None:
            return RequestOutput(st.external_id, st.prompt, st.prompt_token_ids, prompt_logprobs, [completion],
                                 finished, st.num_cached_tokens, self._metrics(st))
        parent = st.parent
        if finished:
            parent.finished.add(st.index)
        all_done = len(parent.finished) == parent.n
        if st.output_kind == RequestOutputKind.FINAL_ONLY:
            parent.completions[st.index] = completion
            if not all_done:
                return None
            outs = [parent.completions[i] for i in sorted(parent.completions)]
        else:
            outs = [completion]
        return RequestOutput(parent.request_id, st.prompt, st.prompt_token_ids, prompt_logprobs, outs, all_done,
                             st.num_cached_tokens, self._metrics(st))

    @staticmethod
    def _metrics(st: RequestState) -> dict:
        return {"arrival_time": st.arrival_time, "first_token_time": st.first_token_time,
                "num_generation_tokens": len(st.token_ids)}
