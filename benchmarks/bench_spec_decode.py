"""Speculative decoding on the default model: output tok/s with and without it, on a
repetitive workload (the answer copies much of the prompt: code edits, extraction,
quoting) and a non-repetitive one, at batch 1, 8 and 64; greedy, so both engines
write the same tokens (checked).

    python benchmarks/bench_spec_decode.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402

CODE = [
    "def total_price(items, tax):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n"
    "    return total * (1 + tax)\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    return None\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step):\n"
    "        self.count += step\n        return self.count\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
]
TEXT = [
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall and was the "
    "tallest man-made structure in the world for 41 years. Gustave Eiffel's company designed and built it.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place in the chloroplasts, which contain the green pigment chlorophyll.",
    "The Amazon river flows through Peru, Colombia and Brazil into the Atlantic Ocean. It carries more water "
    "than any other river, and its basin holds the largest tropical rainforest on Earth.",
    "Ada Lovelace wrote the first published algorithm intended for a machine, Charles Babbage's Analytical "
    "Engine, in 1843. She also saw that such machines could do more than calculate numbers.",
]
REPETITIVE = ([f"Rename the function's variables to longer, clearer names and return the whole code:\n\n{c}"
               for c in CODE]
              + [f"Add a docstring and type hints to this function. Return the full function:\n\n{c}" for c in CODE]
              + [f"Repeat the following paragraph word for word, then list its numbers:\n\n{t}" for t in TEXT]
              + [f"Quote the first two sentences of this text exactly, then summarise it:\n\n{t}" for t in TEXT])
TOPICS = ["the sea", "a lost key", "autumn in a small town", "a robot learning to paint", "the first day of school",
          "a lighthouse keeper", "a city at night", "friendship", "a mountain storm", "an old bookshop"]
NON_REPETITIVE = ([f"Write a short poem about {t}." for t in TOPICS]
                  + [f"Give three tips for someone who is {t}." for t in
                     ("learning to cook", "starting to run", "moving to a new city", "learning a language",
                      "new to gardening", "saving money")])


def run(llm, prompts, sp, batch: int):
    """Output tokens and seconds: ``prompts`` in generate() calls of ``batch`` each."""
    tokens, elapsed, outs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        msgs = [[{"role": "user", "content": p}] for p in prompts[i:i + batch]]
        t0 = time.perf_counter()
        res = llm.chat(msgs, sp, use_tqdm=False)
        elapsed += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in res)
        outs += [o.outputs[0].token_ids for o in res]
    return tokens, elapsed, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--batch1-prompts", type=int, default=3, help="prompts run one at a time at batch 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each engine per row, alternating; the median is reported (this VM's run-to-run "
                         "noise is ~10%%)")
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "non-repetitive"])
    ap.add_argument("--output-json", default=None)
    # The engine's flags, for both engines; --speculative-config: the second one's.
    args, engine_args = parse_engine_args(ap, max_model_len=1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})

    from jaxserve import LLM, SamplingParams

    spec = engine_args.speculative_config
    print("loading the engine without speculation ...", file=sys.stderr)
    base = LLM(**engine_kwargs(engine_args, speculative_config=None))
    print("loading the engine with", spec, "...", file=sys.stderr)
    t0 = time.perf_counter()
    fast = LLM(**engine_kwargs(engine_args))
    print(f"start-up with speculation: {time.perf_counter() - t0:.1f} s, {fast.llm_engine.num_compiled_programs} "
          f"programs (without: {base.llm_engine.num_compiled_programs})", file=sys.stderr)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    pools = {"repetitive": REPETITIVE, "non-repetitive": NON_REPETITIVE}
    for name in args.workloads:
        pool = pools[name]
        for batch in args.batches:
            n = args.batch1_prompts if batch == 1 else batch
            prompts = [pool[i % len(pool)] for i in range(n)]
            before = fast.get_metrics()["spec_decode"]
            base_runs, fast_runs = [], []
            for _ in range(args.repeats):
                base_runs.append(run(base, prompts, sp, batch))
                fast_runs.append(run(fast, prompts, sp, batch))
            after = fast.get_metrics()["spec_decode"]
            tb, eb, ob = sorted(base_runs, key=lambda x: x[1])[len(base_runs) // 2]
            tf, ef, of = sorted(fast_runs, key=lambda x: x[1])[len(fast_runs) // 2]
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            drafts = after["num_drafts"] - before["num_drafts"]
            row = {"workload": name, "batch": batch, "prompts": n, "output_tokens": tb,
                   "base_tok_s": tb / eb, "spec_tok_s": tf / ef, "speedup": (tf / ef) / (tb / eb),
                   "acceptance_rate": accepted / max(drafted, 1), "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                   "same_tokens": ob == of}
            rows.append(row)
            print(f"{name:15s} batch {batch:3d}: {row['base_tok_s']:7.1f} -> {row['spec_tok_s']:7.1f} tok/s "
                  f"(x{row['speedup']:.2f}), acceptance {row['acceptance_rate']:.2f}, mean length "
                  f"{row['mean_acceptance_length']:.2f}, same tokens: {row['same_tokens']}", file=sys.stderr)
    print(machine_line())
    print(commit_line())
    print(f"speculative_config: {json.dumps(spec)}; greedy, max_tokens {args.max_tokens}; median of {args.repeats} "
          "alternating run(s) per engine")
    print("| workload | batch | output tokens | without (tok/s) | with (tok/s) | speedup | acceptance | mean accepted "
          "length | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['output_tokens']} | {r['base_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
              f"| {r['speedup']:.2f}x | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
              f"| {r['same_tokens']} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
