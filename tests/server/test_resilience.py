"""Issue 14: overload, faults, stalled readers, graceful shutdown, engine death.

In-process against the shared tiny engine where the engine survives (its limits are
changed for the test and restored); in a `jaxserve serve` subprocess where the
process itself must exit (SIGTERM, a hung step)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.engine.exceptions import StreamOverflowError
from jaxserve.engine.fault_injection import ENV_VAR, FaultInjector
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from server.app import build_app
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer, wait_until

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def srv(tiny_async_llm):
    s = RunningServer(build_app(tiny_async_llm, "tiny"))
    yield s
    s.stop()


def blocks_all_free(engine) -> bool:
    """``engine`` (an LLMEngine) holds no request and every KV block is free."""
    pools = [s.kv_cache_manager for s in engine.engine_core.schedulers]
    return (not engine.has_unfinished_requests()
            and all(m.block_pool.get_num_free_blocks() == m.block_pool.num_gpu_blocks - 1 for m in pools))


def test_overload_gets_503_with_retry_after(tiny_async_llm, srv, monkeypatch):
    llm = tiny_async_llm
    monkeypatch.setattr(llm, "max_num_waiting_requests", 2)
    monkeypatch.setattr(llm, "max_in_flight", 4)  # 2 running ... (the tiny engine runs 16; the bound is what counts)
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 60, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            streams = [http.post("/v1/completions", json={**body, "stream": s}) for s in [False, True] * 6]
            return await asyncio.gather(*streams)

    t0 = time.monotonic()
    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) == {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert "overloaded" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    assert wait_until(lambda: blocks_all_free(llm.engine))


def test_a_failing_request_fails_alone(tiny_async_llm, srv):
    """Detokenizing one request's token raises: that request gets a 500, its neighbour
    is served as if alone, the engine lives on and frees everything."""
    llm = tiny_async_llm
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        alone = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in ("w5 w6", "w300 w301 w302")]
        victim_tokens = [int(t[1:]) for t in alone[0].split()]
        other_tokens = {int(t[1:]) for t in alone[1].split()}
        bad = next(t for t in victim_tokens if t not in other_tokens)
        llm.engine.fault_injector = FaultInjector(fail_detokenize_token=bad)
        try:
            async def both():
                async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ahttp:
                    return await asyncio.gather(
                        ahttp.post("/v1/completions", json={**body, "prompt": "w5 w6"}),
                        ahttp.post("/v1/completions", json={**body, "prompt": "w300 w301 w302"}))
            victim, other = asyncio.run(both())
        finally:
            llm.engine.fault_injector = None
        assert victim.status_code == 500 and f"detokenizing token {bad}" in victim.json()["error"]["message"]
        assert other.status_code == 200 and other.json()["choices"][0]["text"] == alone[1]
        assert http.get("/health").status_code == 200 and not llm.errored
    assert wait_until(lambda: blocks_all_free(llm.engine))


def test_more_sequences_than_ever_admitted_is_400(tiny_async_llm, srv, monkeypatch):
    """A batch that could never fit, however long the client waits, is the client's
    error (400 naming the field), not a 503 to retry."""
    monkeypatch.setattr(tiny_async_llm, "max_in_flight", 4)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": ["w5"] * 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "at most 4" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"model": "tiny", "n": 5, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "w5"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": ["w5"] * 4, "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_a_grammar_that_fails_to_compile_is_400(tiny_async_llm, srv, monkeypatch):
    """A constraint that validates but whose compile fails (on the worker thread, after
    the request queued) ends that request with a 400; the engine serves on."""
    from jaxserve.sampling_params import StructuredOutputsParams

    manager = tiny_async_llm.engine.engine_core.structured_output_manager
    backend = manager.backend_for(StructuredOutputsParams(regex="w[0-9]+"))

    def broken(params):
        raise RuntimeError("compiler ran out of states")

    monkeypatch.setattr(backend, "compile_grammar", broken)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "guided_regex": "w[0-9]+"}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={**body, "stream": stream})
            # A stream too: its status waits for the first output, so the failure before it is the status.
            assert r.status_code == 400 and "failed to compile" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json={**body, "guided_regex": None}).status_code == 200
    assert wait_until(lambda: blocks_all_free(tiny_async_llm.engine))


def test_draining_answers_503(tiny_async_llm, srv):
    """Once a graceful shutdown began (server/lifecycle.py sets ``app.state.draining`` on
    SIGTERM), a /v1 request that reaches the server, on a connection still open, gets a 503
    with Retry-After and Connection: close; /health still answers; clear the flag and /v1
    serves again."""
    body = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # the connection is open before the drain
        srv.app.state.draining = True
        try:
            late = http.post("/v1/completions", json=body)
            health = http.get("/health")
        finally:
            srv.app.state.draining = False
        assert late.status_code == 503, late.text
        assert late.headers["retry-after"] == "1" and late.headers["connection"] == "close"
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
        assert "shutting down" in late.json()["error"]["message"]
        assert health.status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 200


def test_a_stalled_reader_is_aborted(tiny_async_llm, monkeypatch):
    """A caller that stops reading does not hold its request: past max_queued_outputs
    unread outputs it is aborted (its blocks freed) and reading again raises."""
    llm = tiny_async_llm
    monkeypatch.setattr(llm, "max_queued_outputs", 3)

    async def run():
        gen = llm.generate("w5 w6", SamplingParams(max_tokens=100, ignore_eos=True, temperature=0), "stalled",
                           output_kind=RequestOutputKind.DELTA)
        await anext(gen)  # one output read, then the reader stalls
        ok = await asyncio.to_thread(wait_until, lambda: not llm.engine.has_unfinished_requests(), 30)
        with pytest.raises(StreamOverflowError):
            while True:
                await anext(gen)
        return ok

    assert asyncio.run(run())
    assert wait_until(lambda: blocks_all_free(llm.engine))


# ----------------------------------------------------------------------------- subprocesses
def _serve(tiny_model_dir, tmp_path, *extra, env=None):
    """`jaxserve serve` on a free port; returns (process, url, log path)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / f"serve-{port}.log"
    args = [sys.executable, "-m", "server.cli_serve", "serve", str(tiny_model_dir), "--port", str(port),
            # The session engine's settings: its programs are in the run's compilation cache.
            *[f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
              for k, v in TINY_ENGINE_ARGS.items()], "--served-model-name", "tiny",
            "--uvicorn-log-level", "warning", *extra]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_until(up, timeout=180, interval=0.2), log.read_text()[-3000:]
    return proc, url, log


@pytest.mark.slow
def test_sigterm_finishes_in_flight_then_exits_0(tiny_model_dir, tmp_path):
    """SIGTERM while a stream runs: new connections are refused (any request that gets in
    first is a 503), the stream runs to its end, and the process exits 0."""
    proc, url, log = _serve(tiny_model_dir, tmp_path, "--shutdown-timeout", "20")
    try:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 150, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                if len(chunks) == 3:
                    proc.send_signal(signal.SIGTERM)
                    # The handler logs, then sets the draining flag, on the loop's own thread:
                    # once the line is there, no new request can be served.
                    assert wait_until(lambda: "Shutting down: no new requests" in log.read_text(), timeout=30), \
                        log.read_text()[-3000:]
                    # New connections: refused once uvicorn has closed its socket (a moment
                    # after the signal); a request that still gets in before that: 503.
                    answers = []

                    def refused() -> bool:
                        try:
                            late = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5"},
                                              timeout=10)
                        except httpx.ConnectError:
                            return True
                        answers.append((late.status_code, late.text))
                        return False

                    assert wait_until(refused, timeout=30, interval=0.05), answers[-3:]
                    assert all(code == 503 for code, _ in answers), answers
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 100, chunks[-3:]  # the stream ran to its end
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_hung_step_fails_requests_and_exits_1(tiny_model_dir, tmp_path):
    """The 3rd step stalls for 60 s; the watchdog (1 s) fails the request in flight with
    a 500, /health turns 503, and the process exits 1 (for its supervisor)."""
    proc, url, log = _serve(tiny_model_dir, tmp_path, "--engine-iteration-timeout", "1",
                            env={ENV_VAR: "slow_step=3,slow_seconds=60"})
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 20,
                                                     "ignore_eos": True}, timeout=60)
        assert r.status_code == 500 and "more than 1 s" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 20
        assert proc.wait(30) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_offline_engine_recovers_from_a_failed_step(tiny_model_dir):
    """Offline (LLM.generate) a step that raises ends that call with the error; its
    requests are aborted and the same engine serves the next call, every block free."""
    from jaxserve import LLM
    from jaxserve.engine.fault_injection import InjectedFault

    llm = LLM(model=str(tiny_model_dir), **TINY_ENGINE_ARGS, enforce_eager=True, progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["w5 w6", "w7 w8 w9", "w300"]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = llm.llm_engine
    engine.fault_injector = FaultInjector(raise_at_step=engine.engine_core.num_steps + 3)  # mid-decode
    with pytest.raises(InjectedFault):
        llm.generate(prompts, params)
    engine.fault_injector = None
    # Nothing left to run (the aborted ids wait to be told to the runner with the next step).
    assert not engine.output_processor.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
    assert blocks_all_free(engine)
