"""AsyncLLM directly (reference §7: EN-01..EN-05): streaming deltas, FINAL_ONLY, aborts,
cancellation, request-id reuse, validation in the caller's context, an idle loop that
does not spin."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from tests.server.harness import wait_until

GREEDY_NO_EOS = {"temperature": 0.0, "ignore_eos": True}


def idle(llm: AsyncLLM, timeout: float = 10.0) -> bool:
    return wait_until(lambda: llm.get_stats().num_unfinished_requests == 0, timeout)


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
        deltas = [o async for o in llm.generate("w5 w6 w7", params, "join-delta")]
        final = [o async for o in llm.generate("w5 w6 w7", params, "join-final",
                                               output_kind=RequestOutputKind.FINAL_ONLY)]
        return deltas, final[0]

    deltas, final = asyncio.run(main())
    assert "".join(o.outputs[0].text for o in deltas) == final.outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.outputs[0].token_ids
    assert len(deltas[0].outputs[0].token_ids) == 1  # the first delta comes right after prefill


def test_abort_ends_stream_at_once(tiny_async_llm):
    """EN-03: abort() ends that stream with a final "abort" output (partial tokens kept
    by the caller); the other requests finish normally."""
    llm = tiny_async_llm

    async def consume(rid: str, abort_after: int | None):
        got, last = 0, None
        async for out in llm.generate("w9 w10", SamplingParams(max_tokens=60, **GREEDY_NO_EOS), rid):
            got += len(out.outputs[0].token_ids)
            last = out
            if abort_after is not None and got >= abort_after and not out.finished:
                llm.abort(rid)
                abort_after = None
        return got, last

    async def main():
        return await asyncio.gather(consume("ab-0", 3), consume("ab-1", None), consume("ab-2", None))

    (n0, last0), (n1, last1), (n2, _) = asyncio.run(main())
    assert last0.finished and last0.outputs[0].finish_reason == "abort"
    assert 3 <= n0 < 60
    assert n1 == n2 == 60 and last1.outputs[0].finish_reason == "length"
    assert idle(llm)


def test_cancelled_consumer_aborts_and_id_is_reusable(tiny_async_llm):
    """EN-02 / EN-05: a consumer that stops (cancel, or close after 20 tokens) aborts its
    request; the id can be used again afterwards."""
    llm = tiny_async_llm
    long = SamplingParams(max_tokens=200, **GREEDY_NO_EOS)

    async def read_forever(rid):
        async for _ in llm.generate("w11 w12", long, rid):
            pass

    async def main():
        task = asyncio.create_task(read_forever("reuse-me"))
        await asyncio.sleep(0.15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Close after exactly 20 tokens.
        gen = llm.generate("w11 w12", long, "stop-reading")
        got = 0
        async for out in gen:
            got += len(out.outputs[0].token_ids)
            if got >= 20:
                break
        await gen.aclose()
        assert got >= 20  # a delta may carry several tokens when the reader lags
        # Both ids work again.
        outs = [o async for o in llm.generate("w11 w12", SamplingParams(max_tokens=3, **GREEDY_NO_EOS), "reuse-me")]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
        outs = [o async for o in llm.generate("w11 w12", SamplingParams(max_tokens=2, **GREEDY_NO_EOS),
                                              "stop-reading")]
        assert outs[-1].finished

    asyncio.run(main())
    assert idle(llm, timeout=5)


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
    from jaxserve.engine.async_llm import _ABORTED, RequestStream
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


def settled_steps(llm: AsyncLLM, quiet: float = 0.3, timeout: float = 10.0) -> int:
    """The engine's step count once it has stopped stepping: an earlier test's last step
    may still be in its bookkeeping after that test saw its outputs (num_steps counts a
    step when the step ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = llm.get_stats().num_steps
        time.sleep(quiet)
        if llm.get_stats().num_steps == steps and llm.get_stats().num_unfinished_requests == 0:
            return steps
    raise AssertionError(f"the engine was still stepping after {timeout} s")


def test_validation_errors_in_callers_context(tiny_async_llm):
    llm = tiny_async_llm
    steps = settled_steps(llm)

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
    assert llm.get_stats().num_unfinished_requests == 0
    assert llm.get_stats().num_steps == steps  # nothing reached the engine


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


def test_idle_loop_sleeps(tiny_async_llm):
    """No busy spin: an idle engine thread takes no steps and (almost) no CPU."""
    llm = tiny_async_llm
    assert idle(llm)
    steps = llm.get_stats().num_steps
    stat = f"/proc/self/task/{llm._thread.native_id}/stat"
    if not os.path.exists(stat):
        pytest.skip("needs /proc")

    def cpu_ticks() -> int:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    t0 = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - t0 <= 2
    assert llm.get_stats().num_steps == steps
    assert llm.is_running and not llm.errored
