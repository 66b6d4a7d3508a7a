"""jaxserve.LLM over two processes (4 CPU devices each, one mesh over all 8): process 0
schedules, process 1 replays; tokens equal a single process's, and a dead follower
ends the leader with an error instead of a hang."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from procs import Proc, free_port

from jaxserve import LLM, SamplingParams

WORKER = Path(__file__).with_name("llm_worker.py")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from hf_factory import make_tiny_hf_model

    # 8 query heads, 2 KV heads (replicated 4x at tp 8), a vocabulary 8 does not divide.
    return make_tiny_hf_model(tmp_path_factory.mktemp("mh_llm"), "llama", heads=8, kv_heads=2, vocab=1013)


def _start(model, tmp_path, tp, dp, scenario, *extra):
    port = free_port()
    return [Proc(f"p{pid}", [str(WORKER), str(model), str(pid), str(port), str(tp), str(dp), scenario,
                             *map(str, extra)], tmp_path)
            for pid in (0, 1)]


def _all_tokens(proc) -> list:
    return [json.loads(x[len("TOKENS "):]) for x in proc.out.splitlines() if x.startswith("TOKENS ")]


def _tokens(proc) -> list:
    return _all_tokens(proc)[0]


def _one_process(model) -> list:
    """The worker's requests on one process."""
    import llm_worker

    llm = LLM(str(model), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=2 << 20,
              compilation_cache=False, progress=False, enforce_eager=True)
    outs = llm.generate(llm_worker.prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(model):
    return _one_process(model)


@pytest.mark.timeout(300)
def test_dp_ranks_across_processes_match_one_and_replay_weight_updates(model, reference, tmp_path_factory, tmp_path):
    """tp 4 x dp 2 over two processes gives one process's tokens; update_weights (a folder,
    a dict), sleep / wake (levels 1 and 2) on process 0 are replayed on process 1 (the
    tokens are one process's on the same weights); the leader's shutdown ends the
    follower cleanly."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from hf_factory import make_tiny_hf_model

    other = make_tiny_hf_model(tmp_path_factory.mktemp("mh_llm_other"), "llama", heads=8, kv_heads=2, vocab=1013,
                               seed=1)
    other_reference = _one_process(other)
    assert other_reference != reference
    leader, follower = procs = _start(model, tmp_path, 4, 2, "update", other)
    try:
        assert leader.wait(240) == 0, leader.err[-3000:]
        assert follower.wait(60) == 0, follower.err[-3000:]  # the leader's shutdown ends it cleanly
    finally:
        for p in procs:
            p.kill()
    assert "failed" not in follower.err, follower.err[-3000:]
    assert _all_tokens(leader) == [reference, other_reference, other_reference, reference, other_reference]


@pytest.mark.timeout(300)
def test_tp8_across_processes_matches_one_and_a_dead_follower_ends_the_leader(model, reference, tmp_path):
    leader, follower = procs = _start(model, tmp_path, 8, 1, "forever")
    try:
        leader.wait_for("STEP 1\n", 240)
        assert _tokens(leader) == reference
        follower.kill()
        t0 = time.monotonic()
        code = leader.wait(90)
        waited = time.monotonic() - t0
        assert code != 0 and waited < 60, (code, waited)
        assert "lost follower process 1" in leader.err or "fatal" in leader.err.lower(), leader.err[-3000:]
    finally:
        for p in procs:
            p.kill()
