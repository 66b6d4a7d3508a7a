"""What structured outputs cost (issue 11), on the default model:

1. offline throughput with none vs half of the requests JSON-constrained
   (free requests: fixed length, ignore_eos; constrained: up to the same length,
   ending when their JSON is complete), output tokens/s and engine steps;
2. host time per step for the grammar work at 64 constrained requests: filling the
   [64, ceil(V/32)] bitmask and advancing the matchers by one token;
3. device cost of the always-on mask: the jitted sampler on [R, V] logits with the
   mask vs the same program without it.

    python benchmarks/bench_structured_outputs.py [--backend auto|xgrammar|guidance]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402

from jaxserve.config import STRUCTURED_OUTPUTS_BACKENDS  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "rating": {"enum": ["good", "bad", "ok"]}},
    "required": ["title", "year", "tags", "rating"], "additionalProperties": False}


def offline(llm, n, output_len, frac, seed=0):
    from jaxserve import SamplingParams, StructuredOutputsParams

    tok = llm.get_tokenizer()
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        words = " ".join(rng.choice(["film", "book", "review", "json", "summary", "data"], 20))
        prompts.append(tok.apply_chat_template([{"role": "user", "content": f"Describe as JSON: {words}"}],
                                               tokenize=False, add_generation_prompt=True))
        if i < int(n * frac):
            so = StructuredOutputsParams(json=SCHEMA)
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=output_len, structured_outputs=so))
        else:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=output_len, ignore_eos=True))
    engine = llm.llm_engine
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.num_steps - steps0
    return out_tokens, dt, steps, outs


def host_costs(llm, n=64, reps=50):
    """Fill the [n, W] bitmask for n mid-JSON matchers, and accept one token each."""
    from jaxserve import StructuredOutputsParams

    mgr = llm.llm_engine.structured_output_manager
    params = StructuredOutputsParams(json=SCHEMA)
    backend = mgr.backend_for(params)
    grammars = [backend.compile_grammar(params) for _ in range(n)]
    tok = llm.get_tokenizer()
    prefix = tok.encode('{"title": "A')
    for g in grammars:
        assert g.accept_tokens(prefix)
    bitmask = np.full((n, mgr.num_words), -1, np.int32)
    t0 = time.perf_counter()
    for _ in range(reps):
        for i, g in enumerate(grammars):
            g.fill_bitmask(bitmask, i)
    fill = (time.perf_counter() - t0) / reps
    letter = tok.encode("b")[0]
    t0 = time.perf_counter()
    for _ in range(reps):
        for g in grammars:
            g.accept_tokens([letter])
        for g in grammars:
            g.rollback(1)
    accept = (time.perf_counter() - t0) / reps / 2  # accept + rollback, counted as two
    return backend.name, fill, accept


def mask_device_cost(vocab, rows=(8, 64), reps=40):
    import jax
    import jax.numpy as jnp

    from jaxserve.sample import sampler as sampler_mod
    from jaxserve.sample.metadata import SamplingMetadata

    out = []
    for r in rows:
        rng = np.random.default_rng(0)
        logits = jnp.asarray(rng.standard_normal((r, vocab)), jnp.float32)
        w = (vocab + 31) // 32
        md = SamplingMetadata(
            temperature=np.full(r, 0.7, np.float32), top_k=np.zeros(r, np.int32), top_p=np.ones(r, np.float32),
            min_p=np.zeros(r, np.float32), presence_penalty=np.zeros(r, np.float32),
            frequency_penalty=np.zeros(r, np.float32), repetition_penalty=np.ones(r, np.float32),
            seeds=np.arange(r, dtype=np.uint32), output_pos=np.zeros(r, np.int32),
            stop_ids_masked=np.full((r, 16), -1, np.int32), token_history=np.zeros((r, 1), np.int32),
            prompt_lens=np.zeros(r, np.int32), total_lens=np.zeros(r, np.int32),
            allowed_token_bitmask=np.full((r, w), -1, np.int32))
        real = sampler_mod.apply_grammar_bitmask
        fns = {}
        for label, fn in (("with mask", real), ("without", lambda logits, _m: logits)):
            sampler_mod.apply_grammar_bitmask = fn  # read at trace time
            f = jax.jit(lambda lg, m: sampler_mod.sample(lg, m, greedy_only=False, use_penalties=False,
                                                         num_logprobs=20))
            jax.block_until_ready(f(logits, md))
            fns[label] = f
        sampler_mod.apply_grammar_bitmask = real
        # Interleaved, median: the two programs see the same machine noise.
        times = {label: [] for label in fns}
        for _ in range(reps):
            for label, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(logits, md))
                times[label].append(time.perf_counter() - t0)
        out.append((r, float(np.median(times["with mask"])), float(np.median(times["without"]))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=96)
    # The engine's flags; --backend is this benchmark's short name for --structured-outputs-backend.
    ap.add_argument("--backend", dest="structured_outputs_backend", choices=STRUCTURED_OUTPUTS_BACKENDS,
                    default=argparse.SUPPRESS, help="the engine's --structured-outputs-backend")
    args, engine_args = parse_engine_args(ap, max_model_len=512)

    from jaxserve import LLM

    llm = LLM(**engine_kwargs(engine_args))
    print(machine_line())
    print(commit_line())
    backend, fill, accept = host_costs(llm)
    print(f"host, 64 constrained requests ({backend}): bitmask fill {fill * 1e3:.2f} ms/step, "
          f"accept {accept * 1e3:.3f} ms/step")
    for r, with_mask, without in mask_device_cost(llm.llm_engine.vocab_size):
        print(f"sampler [{r}, V]: {with_mask * 1e3:.2f} ms with the mask, {without * 1e3:.2f} ms without "
              f"(+{(with_mask - without) * 1e3:.2f} ms)")
    offline(llm, 8, 8, 0.5)  # first grammar compiles, tokenizer analysis
    for frac in (0.0, 0.5):
        tokens, dt, steps, outs = offline(llm, args.num_prompts, args.output_len, frac)
        print(f"offline, {int(frac * 100)}% constrained: {tokens} output tokens in {dt:.1f} s = {tokens / dt:.1f} "
              f"tok/s; {steps} steps, {dt / max(steps, 1) * 1e3:.0f} ms/step")
    print("sample constrained output:", outs[0].outputs[0].text[:200])


if __name__ == "__main__":
    main()
