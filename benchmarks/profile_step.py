"""Where a decode step's time goes, at several batch sizes (issue: faster than vLLM).

    python benchmarks/profile_step.py --batch 8 64 256 --steps 20

For each batch size B: B requests of --prompt-len random tokens are prefilled, then
--steps decode steps (every request one token) are timed phase by phase:

  schedule        Scheduler.schedule (host)
  update_states   the runner applies the SchedulerOutput diff to its InputBatch (host)
  prepare_inputs  padded numpy step arrays (host)
  put             device_put of the step's inputs
  model_step      the jitted model step, to completion (device)
    attention     of which attention: the same step with attention replaced by a no-op, subtracted
  sampler         the jitted sampler, to completion (device)
  device_get      sampled tokens and logprobs back to the host
  bookkeeping     the runner records the tokens (host)
  update_output   Scheduler.update_from_output (host)
  process_outputs detokenizer and RequestOutputs (host)

Phases are timed by wrapping the engine's own methods; each device program is run to
completion before the next phase starts (block_until_ready), which the engine does not
do. 'device idle between steps' is the host work the device waits for: from the
sampled tokens of step N back on the host to step N + 1's model program started (with
--async-scheduling, step N + 1 is scheduled before N's tokens are back, and N's outputs
are processed while N + 1 runs). 'step wall time' comes from a second run of --steps
steps with nothing wrapped. Then the XLA:CPU roofline for this model's shapes: matmul
GFLOP/s at M = B and copy bandwidth.
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402

PHASES = ("schedule", "update_states", "prepare_inputs", "put", "model_step", "sampler", "device_get",
          "bookkeeping", "update_output", "process_outputs")


class PhaseTimer:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.active = False

    def wrap(self, obj, name: str, phase: str, block=False):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if block:
                import jax

                out = jax.block_until_ready(out)
            if self.active:
                self.times[phase].append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache size (the engine's --kv-cache-memory)")
    # The engine's flags; the context, batch and KV cache sizes follow from the ones above.
    args, engine_args = parse_engine_args(ap, fixed=("max_model_len", "max_num_seqs", "kv_cache_memory"),
                                          max_num_batched_tokens=2048)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.program_key import ModelStepKey, SampleKey

    max_b = max(args.batch)
    # Requests prefilled first decode while the rest prefill: room for that, so that all B
    # are still running when the timed steps start.
    max_tokens = 2 * args.steps + 8 + -(-max_b * args.prompt_len // args.max_num_batched_tokens)
    llm = LLM(**engine_kwargs(
        engine_args, max_model_len=args.prompt_len + max_tokens + 16, max_num_seqs=max_b,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_b),
        kv_cache_memory=args.kv_cache_gib << 30))  # every batch size's requests fit at once
    engine = llm.llm_engine
    core = engine.engine_core
    sched, runner = core.schedulers[0], core.model_runner
    timer = PhaseTimer()
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(runner, "_update_states", "update_states")
    timer.wrap(runner, "_prepare_inputs", "prepare_inputs")
    timer.wrap(runner, "_put_packed", "put", block=True)
    timer.wrap(runner, "_put", "put", block=True)  # token history / grammar bitmask, when used
    timer.wrap(runner, "_bookkeeping", "bookkeeping")
    timer.wrap(sched, "update_from_output", "update_output")
    timer.wrap(engine.output_processor, "process_outputs", "process_outputs")
    real_run, real_get = runner._run, jax.device_get
    last_model_args = {}

    last_get = [None]  # when the last device_get returned (the tokens of a step are back)

    def run(key, *a):
        if not timer.active:
            return real_run(key, *a)
        t0 = time.perf_counter()
        if isinstance(key, ModelStepKey) and last_get[0] is not None:
            timer.times["idle"].append(t0 - last_get[0])
        out = jax.block_until_ready(real_run(key, *a))
        timer.times["model_step" if isinstance(key, ModelStepKey) else "sampler"].append(time.perf_counter() - t0)
        if isinstance(key, ModelStepKey):
            last_model_args[key.num_tokens] = a
        return out

    def device_get(x):
        t0 = time.perf_counter()
        out = real_get(x)
        if timer.active:
            timer.times["device_get"].append(time.perf_counter() - t0)
            last_get[0] = time.perf_counter()
        return out

    runner._run = run
    jax.device_get = device_get
    vocab = runner.vocab_size
    rng = np.random.default_rng(0)

    def no_attention(q, k, v, kv_cache, layer, md):
        return q, kv_cache

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("layout",))
    def step_without_attention(state, kv_cache, packed, lora_buffers, *, layout):
        # lora_buffers: the model step's adapter slots argument (None: this engine has no LoRA)
        input_ids, positions, md, *_ = layout.unpack(packed)
        model = nnx.merge(runner.graphdef, state)
        hidden, kv_cache = model(input_ids, positions, kv_cache, md, no_attention)
        return hidden, kv_cache

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("layout",))
    def step_with_attention(state, kv_cache, packed, lora_buffers, *, layout):
        input_ids, positions, md, *_ = layout.unpack(packed)
        model = nnx.merge(runner.graphdef, state)
        hidden, kv_cache = model(input_ids, positions, kv_cache, md, runner._attention)
        return hidden, kv_cache

    print(machine_line())
    print(commit_line())
    print(f"model {runner.arch.architecture}, dtype {args.dtype} (activations {jnp.dtype(runner.dtype).name}, "
          f"matmul weights {jnp.dtype(runner.param_dtype).name}), prompt {args.prompt_len} tokens, "
          f"{args.steps} decode steps per batch size, async scheduling {'on' if args.async_scheduling else 'off'}, "
          f"scan_layers {args.scan_layers}, attention {runner.attention_backend}, "
          f"KV cache {jnp.dtype(runner.kv_dtype).name}")
    rows = []
    for b in args.batch:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"b{b}-{i}", {"prompt_token_ids": rng.integers(100, vocab, args.prompt_len).tolist()}, sp)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
            engine.step()
        engine.step()  # first decode step (every request now decodes)
        timer.active, last_get[0] = True, None
        engine.step()  # with async scheduling, this one fetches a step dispatched untimed
        timer.times.clear()
        for _ in range(args.steps):
            engine.step()
        timer.active = False
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - t0) / args.steps
        assert len(sched.running) == b, f"only {len(sched.running)} of {b} requests run at once"
        t_bucket = max(last_model_args)
        a = last_model_args[t_bucket]

        def timed(fn):
            """Best of 5 runs of fn on the last step's inputs (the cache is the live one:
            the steps rewrite the same slots, and the requests are aborted next)."""
            state, _, *rest = a
            best = float("inf")
            for _ in range(6):
                t0 = time.perf_counter()
                _, runner.kv_cache = jax.block_until_ready(
                    fn(state, runner.kv_cache, *rest, layout=runner._model_layout(t_bucket)))
                best = min(best, time.perf_counter() - t0)
            return best

        with_attn, without_attn = timed(step_with_attention), timed(step_without_attention)
        means = {p: 1e3 * float(np.mean(timer.times[p])) if timer.times[p] else 0.0 for p in PHASES}
        host = sum(means[p] for p in ("schedule", "update_states", "prepare_inputs", "bookkeeping",
                                      "update_output", "process_outputs"))
        host = (host, 1e3 * float(np.mean(timer.times["idle"])))
        rows.append((b, t_bucket, wall * 1e3, means, 1e3 * (with_attn - without_attn), 1e3 * with_attn, host))
        for i in range(b):
            engine.abort_request(f"b{b}-{i}")
        while engine.has_unfinished_requests():
            engine.step()

    print("\nper decode step, ms (mean over the timed steps)")
    print("| phase | " + " | ".join(f"B={r[0]} (T={r[1]})" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for p in PHASES:
        print(f"| {p} | " + " | ".join(f"{r[3][p]:.2f}" for r in rows) + " |")
        if p == "model_step":
            print("| (attention, by subtraction) | " + " | ".join(f"{r[4]:.2f} of {r[5]:.2f}" for r in rows) + " |")
    print("| host total (schedule .. process_outputs, no device) | " + " | ".join(f"{r[6][0]:.2f}" for r in rows)
          + " |")
    print("| device idle between steps (host on the critical path) | " + " | ".join(f"{r[6][1]:.2f}" for r in rows)
          + " |")
    print("| step wall time | " + " | ".join(f"{r[2]:.2f}" for r in rows) + " |")
    print("| decode tokens/s | " + " | ".join(f"{r[0] / r[2] * 1e3:.0f}" for r in rows) + " |")
    roofline(runner, args.batch)


def roofline(runner, batches) -> None:
    """Matmul GFLOP/s of this model's projections at M = B, and copy bandwidth."""
    import jax
    import jax.numpy as jnp

    a = runner.arch
    shapes = {"qkv": (a.hidden_size, (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim),
              "gate/up": (a.hidden_size, 2 * a.intermediate_size), "down": (a.intermediate_size, a.hidden_size),
              "lm_head": (a.hidden_size, a.vocab_size)}
    from models.quantization import matmul

    print("\nXLA:CPU matmul GFLOP/s ([M, K] @ [K, N], best of 10): float32, and bf16 weights "
          "(x rounded to bf16, float32 accumulation: models.quantization.matmul)")
    print("| M | weights | " + " | ".join(f"{k} {v[0]}x{v[1]}" for k, v in shapes.items()) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for m in batches:
        for wdt in (jnp.float32, jnp.bfloat16):
            cells = []
            for k, n in shapes.values():
                x, w = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), wdt)
                f = jax.jit(matmul)
                jax.block_until_ready(f(x, w))
                best = float("inf")
                for _ in range(10):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x, w))
                    best = min(best, time.perf_counter() - t0)
                cells.append(f"{2 * m * k * n / best / 1e9:.1f}")
            print(f"| {m} | {jnp.dtype(wdt).name} | " + " | ".join(cells) + " |")
    x = jnp.ones((64 << 20) // 4, jnp.float32)  # 64 MiB
    f = jax.jit(lambda x: x + 1)
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    print(f"\ncopy bandwidth (read + write 64 MiB): {2 * x.nbytes / best / 1e9:.1f} GB/s")
    leaves = jax.tree.leaves(runner.state)
    params, nbytes = sum(v.size for v in leaves), sum(v.nbytes for v in leaves)
    print(f"params: {params / 1e6:.1f} M ({nbytes / 2**20:.0f} MiB read per step)")


if __name__ == "__main__":
    main()
