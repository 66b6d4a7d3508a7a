#!/usr/bin/env python3
"""Every command that README.md and docs/ show, run as written or at its smallest size.

Long runs (the soak and fuzz runs, the benchmarks) are run here with small counts; the
docs mark them as long runs and name this variant (docs/testing.md lists each command
and where CI runs it). Each entry: a name, the shell command, a time limit, and what its
output must contain. Run from the repository root after `make install-test`:

    python3 .ci/documented_commands.py [NAME ...]
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = ".venv/bin/python"
TMP = Path(tempfile.mkdtemp(prefix="jaxserve-docs-"))
# The default model's GGUF file, as `jaxserve convert FILE.gguf OUT_DIR` takes it.
GGUF = f"$({PY} -c 'from models.default_model import default_gguf_path; print(default_gguf_path())')"
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")

# (name, command, timeout in s, regex the output must match)
COMMANDS: list[tuple[str, str, int, str]] = [
    *[(f"help:{b}", f"{PY} benchmarks/{b} --help", 120, r"usage:") for b in BENCHMARKS],
    ("convert:hf", f"{PY} -m jaxserve.cli convert {GGUF} {TMP}/smollm2-hf", 300, r""),
    ("convert:orbax", f"{PY} -m jaxserve.cli convert {TMP}/smollm2-hf {TMP}/smollm2-orbax --format orbax "
     "--dtype bfloat16", 300, r""),
    # README's and docs/testing.md's single file / directory runs (a file alone once failed).
    ("one file", ".venv/bin/pytest -q tests/e2e/test_default_model.py", 600, r"\d+ passed"),
    ("one directory", ".venv/bin/pytest -q tests/server", 900, r"\d+ passed"),
    ("some tests of a file", ".venv/bin/pytest -q tests/core/test_scheduler.py -k preempt", 300, r"\d+ passed"),
    ("capacity_plan", f"{PY} benchmarks/capacity_plan.py", 120, r"\S"),
    ("capacity_plan gpt-oss", f"{PY} benchmarks/capacity_plan.py --model gpt-oss-120b", 120, r"h200 x 8 chips"),
    ("capacity_plan deepseek-v3", f"{PY} benchmarks/capacity_plan.py --model deepseek-v3", 120, r"latent"),
    ("bench_throughput", f"{PY} benchmarks/bench_throughput.py --num-prompts 4 --input-len 16 --output-len 4 "
     f"--also-dtype float32 --plot {TMP}/throughput.png", 600, r"(?s)Throughput: .* output tokens/s.*chart: "),
    ("bench_serving", f"{PY} benchmarks/bench_serving.py --launch --max-concurrency 1 2 --num-prompts 2 4 "
     f"--input-len 16 --output-len 4 --plot {TMP}/serving.png", 600, r"(?is)ttft.*chart: "),
    ("bench_kernels", f"{PY} benchmarks/bench_kernels.py --small --iters 1", 600, r"\S"),
    # docs/batch_invariance.md: its cost and exactness runs (and `serve --batch-invariant`), smallest.
    ("batch-invariant throughput", f"{PY} benchmarks/bench_throughput.py --num-prompts 4 --input-len 16 "
     "--output-len 4 --also-batch-invariant", 600, r"--batch-invariant .*\|"),
    ("batch-invariant serving", f"{PY} benchmarks/bench_serving.py --launch --max-concurrency 1 --num-prompts 2 "
     "--input-len 16 --output-len 4 --server-args=--batch-invariant", 600, r"(?is)ttft"),
    ("batch-invariant speculation", f"{PY} benchmarks/bench_spec_decode.py --batch-invariant --batches 1 2 "
     "--batch1-prompts 1 --max-tokens 16 --workloads repetitive", 900, r"(?s)(\| True \|.*){2}"),
    ("profile_step", f"{PY} benchmarks/profile_step.py --batch 2 --steps 2", 600, r"\S"),
    # The two-process example of docs/scale_out.md, as written, then one request and Ctrl-C.
    ("multihost example", """
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=3
ARGS="-tp 3 -dp 2 --max-model-len 512 --distributed-coordinator-address 127.0.0.1:7777 --num-processes 2"
.venv/bin/jaxserve serve $ARGS --process-id 1 & F=$!
.venv/bin/jaxserve serve $ARGS --process-id 0 & L=$!
for i in $(seq 500); do curl -sf localhost:8000/v1/models >/dev/null && break; sleep 1; done
curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4}'
kill -INT $L; wait $L; wait $F
""", 600, r'"text"'),
    # docs/research_loop.md: the example, the benchmark (one repeat) and the server's routes as written.
    ("rl_grpo example", f"{PY} examples/rl_grpo.py --steps 8", 600, r"step +7 +mean reward"),
    ("bench_weight_update", f"{PY} benchmarks/bench_weight_update.py --repeats 1", 600,
     r"compiles during updates, sleep and wake: 0\ngreedy outputs after == before: True"),
    ("weight routes", r"""
.venv/bin/jaxserve serve --enable-weight-updates & S=$!
for i in $(seq 300); do curl -sf localhost:8000/v1/models >/dev/null && break; sleep 1; done
MODEL_DIR=$(.venv/bin/python -c 'from models.default_model import default_model_dir; print(default_model_dir())')
curl -sf -X POST localhost:8000/update_weights_from_disk -H 'Content-Type: application/json' \
  -d "{\"model_path\": \"$MODEL_DIR\"}"
curl -sf -X POST 'localhost:8000/sleep?level=1'
curl -sf localhost:8000/is_sleeping
curl -sf -X POST localhost:8000/wake_up
curl -sf -X POST 'localhost:8000/pause?mode=wait'; curl -sf -X POST localhost:8000/resume
kill -INT $S; wait $S
""", 600, r'(?s)"weights_version":1.*"kv_cache":\d+.*"is_sleeping":true.*"is_sleeping":false.*"is_paused":false'),
    # docs/api.md: the generation routes' examples as written (Responses, Messages, count_tokens, token controls).
    ("api routes", r"""
.venv/bin/jaxserve serve & S=$!
for i in $(seq 300); do curl -sf localhost:8000/v1/models >/dev/null && break; sleep 1; done
curl -sf localhost:8000/v1/responses -H 'Content-Type: application/json' -d '{"input": "Hi", "max_output_tokens": 16}'
curl -sf localhost:8000/v1/messages -H 'Content-Type: application/json' -d '{"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}'
curl -sf localhost:8000/v1/messages/count_tokens -H 'Content-Type: application/json' -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "bad_words": ["Paris"], "logit_bias": {"198": -100}}'
kill -INT $S; wait $S
""", 600, r'(?s)"object":"response".*"type":"message".*"stop_reason".*"input_tokens":\d+.*"text_completion"'),
    # docs/lora.md: the offline example (on adapters the benchmark writes), the benchmark
    # at its smallest, and the server example as written.
    ("lora adapters", f"{PY} benchmarks/bench_lora.py --save-adapters /tmp/loras --ranks 8 --lora-counts 2", 300,
     r"/tmp/loras/r8-1"),
    ("lora offline", f"""{PY} - <<'EOF'
from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest

llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8)
sql, chat = LoRARequest("sql", 1, "/tmp/loras/r8-0"), LoRARequest("chat", 2, "/tmp/loras/r8-1")
outs = llm.generate(["The capital of France is"] * 3, SamplingParams(max_tokens=8), lora_request=[sql, None, chat])
print([o.outputs[0].text for o in outs], llm.list_loras())
EOF""", 600, r"\{1, 2\}"),
    ("bench_embeddings", f"{PY} benchmarks/bench_embeddings.py --size tiny --cells 1x16 4x32", 600,
     r"\| jaxserve \| 4x32 \|"),
    ("bench_lora", f"{PY} benchmarks/bench_lora.py --num-prompts 4 --input-len 16 --output-len 4 --ranks 8 "
     "--lora-counts 0 1 --repeats 1", 600, r"\| jaxserve \| 8 \| 1 \|"),
    ("lora serve", r"""
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 .venv/bin/jaxserve serve --enable-lora --max-loras 2 --max-lora-rank 8 \
    --lora-modules sql=/tmp/loras/r8-0 & S=$!
for i in $(seq 300); do curl -sf localhost:8000/v1/models >/dev/null && break; sleep 1; done
curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "sql", "prompt": "The capital of France is", "max_tokens": 8}'
curl -X POST localhost:8000/v1/load_lora_adapter -H 'Content-Type: application/json' \
    -d '{"lora_name": "chat", "lora_path": "/tmp/loras/r8-1"}'
curl -X POST localhost:8000/v1/unload_lora_adapter -H 'Content-Type: application/json' -d '{"lora_name": "chat"}'
kill -INT $S; wait $S
""", 600, r'(?s)"model":"sql".*added successfully.*removed successfully'),
    ("soak (long run: JAXSERVE_SOAK_REQUESTS=5000)",
     "JAXSERVE_SOAK_REQUESTS=24 JAXSERVE_SOAK_CONCURRENCY=8 .venv/bin/pytest -q -s "
     "tests/server/test_soak.py", 600, r"\d+ passed"),
    ("fuzz (long run: JAXSERVE_FUZZ_EXAMPLES=2000)",
     "JAXSERVE_FUZZ_EXAMPLES=3 .venv/bin/pytest -q -s tests/server/test_fuzz_openapi.py",
     600, r"\d+ passed"),
]


def run(name: str, cmd: str, timeout: int, expect: str) -> bool:
    print(f"[docs] {name}: $ {cmd}", flush=True)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        print(f"[docs] FAILED {name}: over {timeout} s\n{out[-3000:]}", flush=True)
        return False
    ok = p.returncode == 0 and re.search(expect, out) is not None
    print(f"[docs] {'ok' if ok else 'FAILED'} {name} (exit {p.returncode}, {time.monotonic() - t0:.1f} s)",
          flush=True)
    if not ok:
        print(out[-4000:], flush=True)
    return ok


def main() -> int:
    wanted = sys.argv[1:]
    chosen = [c for c in COMMANDS if not wanted or any(c[0].startswith(w) for w in wanted)]
    failed = [c[0] for c in chosen if not run(*c)]
    print(f"[docs] {len(chosen) - len(failed)} of {len(chosen)} documented commands ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
