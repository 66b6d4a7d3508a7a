"""One process of a two-process ``jaxserve.LLM`` run (started by
tests/distributed/test_multihost_engine.py, never imported by pytest).

The same script on every process, as a user would run it: ``LLM(...)`` returns on
process 0 only (followers replay its steps inside the constructor and exit 0 when
it shuts down). Process 0 prints the greedy tokens as one JSON line "TOKENS [...]".

usage: llm_worker.py MODEL PROCESS_ID PORT TP DP SCENARIO [OTHER_MODEL]
  scenarios: once (generate, print, exit), forever (generate until killed; prints "STEP"),
  update (the research loop, replayed on the follower: OTHER_MODEL's folder, sleep 1 / wake,
  MODEL's tensors as a dict, sleep 2 + OTHER_MODEL's folder while asleep + wake; prints
  "TOKENS" after each)
"""
from __future__ import annotations

import json
import sys

import numpy as np


def prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(3, 1000, n).tolist()} for n in (5, 40, 17, 90)]


def main() -> int:
    model, pid, port, tp, dp, scenario = sys.argv[1:7]
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=int(tp), data_parallel_size=int(dp), max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_memory=2 << 20, compilation_cache=False, progress=False,
              enforce_eager=True,  # compile on first use: fewer programs, for a quick test
              distributed_coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
    assert pid == "0", "only the leader returns from LLM()"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts(), sp, use_tqdm=False)
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    if scenario == "update":
        from pathlib import Path

        from safetensors.numpy import load_file

        other = sys.argv[7]
        for change in ([("update_weights", other)], [("sleep", 1), ("wake_up", None)],
                       [("update_weights", load_file(str(Path(model) / "model.safetensors")))],
                       [("sleep", 2), ("update_weights", other), ("wake_up", None)]):
            for method, arg in change:
                getattr(llm, method)(arg)
            outs = llm.generate(prompts(), sp, use_tqdm=False)
            print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    step = 0
    while scenario == "forever":
        llm.generate(prompts(), sp, use_tqdm=False)
        step += 1
        print("STEP", step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
