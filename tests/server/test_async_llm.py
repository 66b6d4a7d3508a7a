"""AsyncLLM directly (docs/vllm_behaviours.md §7: EN-01..EN-05): streaming deltas, FINAL_ONLY, aborts,
cancellation, request-id reuse, validation in the caller's context, an idle loop that
does not spin."""
from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from tests.server.harness import wait_until

GREEDY_NO_EOS = {"temperature": 0.0, "ignore_eos": True}


def idle(llm: AsyncLLM, timeout: float = 10.0) -> bool:
    return wait_until(lambda: llm.get_stats().num_unfinished_requests == 0, timeout)


def generated(llm: AsyncLLM, request_id: str) -> int:
    """Tokens the engine has produced for the stream of ``request_id`` (0 once it is gone)."""
    stream = llm._streams.get(request_id)
    return 0 if stream is None else stream.num_generation_tokens


class HoldEngine:
    """A stat logger that holds the engine thread, so that a test decides what a reader
    has been sent instead of racing the engine. Stat loggers run on the engine thread after
    each iteration's step and before its outputs are delivered (AsyncLLM._run_engine_loop):
    once ``when()`` is true at the end of an iteration, that iteration's outputs still go
    out, and every later iteration waits, with its outputs undelivered and the next step not
    begun, until release(). A context manager: installed on entry, released and removed on
    exit. ``timed_out``: a wait gave up (the test waited for something that never came)."""

    def __init__(self, llm: AsyncLLM, when, timeout: float = 30.0) -> None:
        self.llm, self.when, self.timeout = llm, when, timeout
        self.armed = False
        self.released = threading.Event()
        self.timed_out = False

    def record(self, engine_stats, iteration_stats) -> None:
        if self.released.is_set():
            return
        if self.armed:
            self.timed_out |= not self.released.wait(self.timeout)
        else:
            self.armed = self.when()

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> "HoldEngine":
        self.llm.stat_loggers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.llm.stat_loggers.remove(self)


class FinishedRecorder:
    """A stat logger that keeps the engine's FinishedRequestStats, in the order requests end."""

    def __init__(self) -> None:
        self.finished = []

    def record(self, engine_stats, iteration_stats) -> None:
        if iteration_stats is not None:
            self.finished.extend(iteration_stats.finished_requests)


def test_load_delta_and_final_only(tiny_async_llm):
    """EN-01 / EN-04: every request yields exactly max_tokens tokens (x n); only the
    last output has finished=True."""
    llm = tiny_async_llm

    async def one(i: int, kind: RequestOutputKind, n: int):
        params = SamplingParams(max_tokens=10, n=n, ignore_eos=True, temperature=0.0 if n == 1 else 1.0, seed=i)
        outs = [o async for o in llm.generate([5 + i % 50, 6, 7], params, f"load-{kind.name}-{n}-{i}",
                                              output_kind=kind)]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        per_index: dict[int, int] = {}
        for o in outs:
            for c in o.outputs:
                per_index[c.index] = per_index.get(c.index, 0) + len(c.token_ids)
        assert per_index == {j: 10 for j in range(n)}
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        return outs

    async def main():
        jobs = [one(i, kind, n) for i in range(12) for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
                for n in (1, 3)]
        await asyncio.gather(*jobs)

    asyncio.run(main())
    assert idle(llm)


def test_delta_text_joins_to_final_text(tiny_async_llm):
    llm = tiny_async_llm
    params = SamplingParams(max_tokens=12, **GREEDY_NO_EOS)

    async def main():
        # The engine holds after the iteration that sent the first token until the reader
        # has its first delta: that delta is all the engine sent first, however late the
        # reader (a lagging reader's deltas are merged).
        deltas = []
        with HoldEngine(llm, lambda: generated(llm, "join-delta") >= 1) as hold:
            async for o in llm.generate("w5 w6 w7", params, "join-delta"):
                deltas.append(o)
                hold.release()
        final = [o async for o in llm.generate("w5 w6 w7", params, "join-final",
                                               output_kind=RequestOutputKind.FINAL_ONLY)]
        return deltas, final[0], hold

    deltas, final, hold = asyncio.run(main())
    assert not hold.timed_out, "the reader never saw the token the engine produced first"
    assert "".join(o.outputs[0].text for o in deltas) == final.outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.outputs[0].token_ids
    assert len(deltas[0].outputs[0].token_ids) == 1  # the first delta comes right after prefill


def test_abort_ends_stream_at_once(tiny_async_llm):
    """EN-03: abort() ends that stream with a final "abort" output (partial tokens kept
    by the caller) without waiting for the engine; the other requests finish normally."""
    llm = tiny_async_llm
    assert idle(llm)

    async def consume(rid: str, abort_after: int | None, hold: HoldEngine | None = None):
        got, last = 0, None
        try:
            async for out in llm.generate("w9 w10", SamplingParams(max_tokens=60, **GREEDY_NO_EOS), rid):
                got += len(out.outputs[0].token_ids)
                last = out
                if abort_after is not None and got >= abort_after and not out.finished:
                    llm.abort(rid)
                    abort_after = None
        finally:
            if hold is not None:
                hold.release()  # only once the stream has ended
        return got, last

    async def main():
        # The engine holds once it has sent ab-0 its 3rd token, until ab-0's stream has
        # ended: the stream must end on abort() alone (an abort that waited for the engine
        # would wait for ever, and the hold time out), and after exactly those 3 tokens.
        with HoldEngine(llm, lambda: generated(llm, "ab-0") >= 3) as hold:
            results = await asyncio.gather(consume("ab-0", 3, hold), consume("ab-1", None), consume("ab-2", None))
        return results, hold

    ((n0, last0), (n1, last1), (n2, _)), hold = asyncio.run(main())
    assert not hold.timed_out, "ab-0's stream did not end while the engine was held"
    assert last0.finished and last0.outputs[0].finish_reason == "abort"
    assert n0 == 3  # one token a step, and the 4th was held until the stream had ended
    assert n1 == n2 == 60 and last1.outputs[0].finish_reason == "length"
    assert idle(llm)


def test_cancelled_consumer_aborts_and_id_is_reusable(tiny_async_llm):
    """EN-02 / EN-05: a consumer that stops (cancel, or close after 20 tokens) aborts its
    request in the engine; the id can be used again afterwards."""
    llm = tiny_async_llm
    long = SamplingParams(max_tokens=200, **GREEDY_NO_EOS)
    assert idle(llm)
    ended = FinishedRecorder()  # the engine's account of how each request ended

    async def read_forever(rid, first: asyncio.Event):
        async for _ in llm.generate("w11 w12", long, rid):
            first.set()

    async def main():
        # Each consumer stops while the engine holds (after the 1st token, after the 20th):
        # the request cannot run to its 200th token before the abort reaches the engine.
        with HoldEngine(llm, lambda: generated(llm, "reuse-me") >= 1) as hold:
            first = asyncio.Event()
            task = asyncio.create_task(read_forever("reuse-me", first))
            await first.wait()  # the request is in the engine and streaming
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not hold.timed_out
        # Close after exactly 20 tokens.
        with HoldEngine(llm, lambda: generated(llm, "stop-reading") >= 20) as hold:
            gen = llm.generate("w11 w12", long, "stop-reading")
            got = 0
            async for out in gen:
                got += len(out.outputs[0].token_ids)
                if got >= 20:
                    break
            await gen.aclose()
        assert not hold.timed_out
        assert got == 20  # the engine held the 21st token until the close
        # Both ids work again.
        outs = [o async for o in llm.generate("w11 w12", SamplingParams(max_tokens=3, **GREEDY_NO_EOS), "reuse-me")]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
        outs = [o async for o in llm.generate("w11 w12", SamplingParams(max_tokens=2, **GREEDY_NO_EOS),
                                              "stop-reading")]
        assert outs[-1].finished

    llm.stat_loggers.append(ended)
    try:
        asyncio.run(main())
        assert idle(llm, timeout=5)
        assert wait_until(lambda: len(ended.finished) == 4)
    finally:
        llm.stat_loggers.remove(ended)
    # Stats first, then outputs: each request's end is recorded before its caller sees it.
    assert [f.finish_reason for f in ended.finished] == ["abort", "abort", "length", "length"]
    assert all(f.num_generation_tokens < 200 for f in ended.finished[:2])


def test_late_close_of_an_aborted_stream_spares_the_reused_id(tiny_async_llm):
    """abort("r"), then a new request "r": closing the first generator afterwards must
    not abort the new one (the abort names the stream, not the id)."""
    llm = tiny_async_llm

    async def main():
        old = llm.generate("w9 w10", SamplingParams(max_tokens=200, **GREEDY_NO_EOS), "r")
        await old.__anext__()
        llm.abort("r")
        new = llm.generate("w9 w10", SamplingParams(max_tokens=5, **GREEDY_NO_EOS), "r")
        outs = [await new.__anext__()]
        await old.aclose()  # the old stream's clean-up runs after the new request started
        outs += [o async for o in new]
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert idle(llm)


def test_abort_keeps_outputs_queued_before_it():
    """Outputs the engine queued before abort() reach the caller, including a choice's
    finish; only the choices still open end with "abort"."""
    from jaxserve.engine.request_stream import _ABORTED, RequestStream
    from jaxserve.outputs import CompletionOutput, RequestOutput

    def out(index, tokens, finish=None):
        return RequestOutput("x", None, [1], None, [CompletionOutput(index, "t" * len(tokens), tokens, None, None,
                                                                     finish_reason=finish)], finished=False)

    stream = RequestStream("x", None, 2, None, [1])
    merged = AsyncLLM._merge([out(0, [5]), out(0, [6], "length"), out(1, [7]), _ABORTED], stream, set())
    assert [(o.outputs[0].index, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in merged[:-1]] == [
        (0, [5, 6], "length"), (1, [7], None)]
    final = merged[-1]
    assert final.finished and [(c.index, c.finish_reason) for c in final.outputs] == [(1, "abort")]
    # A choice the caller already saw finish is not aborted again.
    merged = AsyncLLM._merge([_ABORTED], stream, {1})
    assert [(c.index, c.finish_reason) for c in merged[0].outputs] == [(0, "abort")]


def settled_steps(llm: AsyncLLM, timeout: float = 10.0) -> int:
    """The engine's step count once it has nothing left to do: no command waiting, no
    request in it, and its last step's stats published (an earlier test's last step may
    still be in its bookkeeping after that test saw its outputs). From then on it takes
    no step until something is posted to it."""
    def settled() -> bool:
        stats = llm.get_stats()
        return (not llm._inbox and not llm.engine.has_unfinished_requests()
                and stats.num_unfinished_requests == 0 and stats.num_steps == llm.engine.num_steps)

    assert wait_until(settled, timeout), "the engine did not settle"
    return llm.engine.num_steps


def test_validation_errors_in_callers_context(tiny_async_llm, monkeypatch):
    llm = tiny_async_llm
    steps = settled_steps(llm)
    posted = []  # every command sent to the engine thread
    post = llm._post
    monkeypatch.setattr(llm, "_post", lambda cmd: (posted.append(cmd), post(cmd)))

    async def first(prompt, params, rid):
        async for out in llm.generate(prompt, params, rid):
            return out

    p = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(first("", p, "bad-1"))
    with pytest.raises(ValueError, match="out of vocabulary"):
        asyncio.run(first([5, 100_000], p, "bad-2"))
    with pytest.raises(ValueError, match="logprobs"):
        asyncio.run(first("w5", SamplingParams(max_tokens=4, logprobs=50), "bad-3"))
    with pytest.raises(TypeError):
        asyncio.run(first("w5", p, 123))
    assert posted == []  # nothing reached the engine: each error was raised before the request was sent
    assert llm.get_stats().num_unfinished_requests == 0
    assert llm.engine.num_steps == steps


def test_duplicate_request_id_is_rejected(tiny_async_llm):
    llm = tiny_async_llm

    async def main():
        gen = llm.generate("w5", SamplingParams(max_tokens=100, **GREEDY_NO_EOS), "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            async for _ in llm.generate("w5", SamplingParams(max_tokens=2), "dup"):
                pass
        await gen.aclose()

    asyncio.run(main())
    assert idle(llm)


def engine_thread_asleep(llm: AsyncLLM) -> bool:
    """The engine thread is blocked in an untimed Condition.wait of its loop: it runs
    again only when a command or shutdown notifies it (no polling, no spinning)."""
    frame = sys._current_frames().get(llm._thread.ident)
    while frame is not None and frame.f_code is not threading.Condition.wait.__code__:
        frame = frame.f_back
    return (frame is not None and frame.f_locals.get("timeout") is None and frame.f_back is not None
            and frame.f_back.f_code is AsyncLLM._run_engine_loop.__code__)


def test_idle_loop_sleeps(tiny_async_llm):
    """No busy spin: an idle engine thread sleeps until it is given work, and takes no steps."""
    llm = tiny_async_llm
    steps = settled_steps(llm)
    assert wait_until(lambda: engine_thread_asleep(llm)), "the idle engine thread is not asleep in an untimed wait"
    assert llm.engine.num_steps == steps
    assert llm.is_running and not llm.errored
