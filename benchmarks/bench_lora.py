"""Multi-LoRA offline throughput (issue 32): the default model without LoRA, then with
--enable-lora (max_loras 4) serving 0, 1 and 4 random adapters of each rank (the
prompts' adapters taken in turn), one LLM.generate over all prompts each (--repeats
rounds, the median of each). Each engine runs in a process of its own, as the peer's do.

    python benchmarks/bench_lora.py --num-prompts 64 --input-len 128 --output-len 64
    python benchmarks/bench_lora.py --peer vllm --peer-python ../vllm-venv/bin/python

Prefix caching is off in every engine: the rounds repeat the same prompts, and with it on
a run after one of the same adapter skips the prompts' prefill (the no-LoRA rounds all
hit the cache, a LoRA engine's 0-adapter round after a 4-adapter round mostly missed:
that read as a 0.64 LoRA overhead, 1.00 with the cache off).

The adapters are PEFT folders written here with random A and B for all seven
projections (both engines read the same files). With --peer vllm, vLLM's CPU build runs
the same prompts and adapters first, in its own environment (peer_throughput.py
--lora-dirs), at its default dtype (bfloat16 on x86) unless --peer-dtype says otherwise.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_throughput import make_prompts, peer_python  # noqa: E402
from common import commit_line, engine_kwargs, machine_line, parse_engine_args, run_peer_script  # noqa: E402

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for ``model_dir`` with random A, B (every projection of every layer)."""
    from safetensors.numpy import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for group, names in MODULES.items():
            for name in names:
                d_in, d_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{group}.{name}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((d_out, rank))).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": 2 * rank, "target_modules": [n for names in MODULES.values() for n in names],
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "modules_to_save": None}))
    return out


def jaxserve_engine(args, engine_args, model_dir: Path, rank: int | None, adapters: list[Path]):
    """(LLM, its adapters' LoRARequests): LoRA on (max_loras = the adapters) when ``rank``."""
    from jaxserve import LLM
    from jaxserve.lora import LoRARequest

    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                max_cpu_loras=len(adapters)) if rank else {}
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(engine_args, model=str(model_dir), enable_prefix_caching=False, **lora),
              compilation_cache=not args.no_compilation_cache)
    print(f"jaxserve rank {rank or '-'}: started in {time.perf_counter() - t0:.1f} s", flush=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] if rank else []
    for lr in loras:  # read before the clock, as the peer does
        llm.add_lora(lr)
    return llm, loras


def run_jaxserve(args, engine_args, model_dir: Path, prompts, adapters: list[Path], rank: int | None) -> list[dict]:
    """One engine (LoRA at ``rank``, or none) in this process: --repeats rounds of each
    adapter count after an untimed one (the first generate of an engine runs cold); the
    median of each."""
    from jaxserve import SamplingParams

    llm, loras = jaxserve_engine(args, engine_args, model_dir, rank, adapters)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    counts = args.lora_counts if rank else [0]
    times: dict[int, list[float]] = {c: [] for c in counts}
    produced = {}
    for rep in range(-1, args.repeats):
        for count in counts:
            chosen = [loras[i % count] if count else None for i in range(len(prompts))]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=chosen)
            if rep < 0:
                continue
            times[count].append(time.perf_counter() - t0)
            produced[count] = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"round {rep + 1}: jaxserve rank {rank or '-'} adapters {count}: "
                  f"{produced[count] / times[count][-1]:.1f} output tok/s", flush=True)
    return [{"engine": "jaxserve", "rank": rank, "num_adapters": count,
             "output_tokens_per_s": produced[count] / float(np.median(times[count]))} for count in counts]


def run_jaxserve_apart(rank: int | None, adapters: list[Path]) -> list[dict]:
    """run_jaxserve in a process of its own (this script with --only-rank), as the peer's
    ranks run: with three engines held in one process, each ran slower than alone (no
    LoRA: 128 tok/s there, 185 alone)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only-rank", str(rank or 0),
           "--adapter-paths", *map(str, adapters)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    print("\n".join(line for line in out.splitlines() if line.startswith(("round", "jaxserve"))), flush=True)
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"engine"')]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--lora-counts", type=int, nargs="+", default=[0, 1, 4],
                    help="adapters in use per run (the engine has max_loras = the largest)")
    ap.add_argument("--peer", choices=("vllm",), nargs="*", default=[])
    ap.add_argument("--peer-python", nargs="+", default=[])
    ap.add_argument("--peer-dtype", default="auto")
    ap.add_argument("--save-adapters", default=None, metavar="DIR",
                    help="only write the random adapters (DIR/r{rank}-{i}, the largest --lora-counts of each "
                         "rank) and exit: adapters to try --lora-modules and the load route with")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per case (jaxserve; the median)")
    ap.add_argument("--no-compilation-cache", action="store_true")
    ap.add_argument("--only-rank", type=int, default=None, help=argparse.SUPPRESS)  # one engine: run_jaxserve_apart
    ap.add_argument("--adapter-paths", nargs="*", default=[], help=argparse.SUPPRESS)
    args, engine_args = parse_engine_args(ap, max_model_len=1024)

    from models.default_model import default_model_dir

    model_dir = Path(engine_args.model) if engine_args.model else default_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args, vocab)
    if args.only_rank is not None:
        for row in run_jaxserve(args, engine_args, model_dir, prompts, [Path(p) for p in args.adapter_paths],
                                args.only_rank or None):
            print(json.dumps(row), flush=True)
        return
    tmp = Path(args.save_adapters or tempfile.mkdtemp(prefix="jaxserve-lora-bench-"))
    n = max(args.lora_counts)
    adapters = {r: [write_random_adapter(model_dir, tmp / f"r{r}-{i}", r, seed=100 * r + i) for i in range(n)]
                for r in args.ranks}
    if args.save_adapters:
        print("\n".join(str(p) for ps in adapters.values() for p in ps))
        return
    print(machine_line())
    print(commit_line())
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.output_len} out; adapters: ranks {args.ranks}, all 7 projections, max_loras {n}")
    rows = []
    for name in args.peer:
        flags = ["--output-len", str(args.output_len), "--batch-size", str(engine_args.max_num_seqs),
                 "--max-model-len", str(engine_args.max_model_len), "--dtype", args.peer_dtype, "--no-prefix-caching"]
        rows += [r | {"rank": None, "num_adapters": 0}
                 for r in [run_peer_script(peer_python(args, name), prompts, name, str(model_dir), *flags)]]
        for r in args.ranks:
            rows += [x | {"rank": r} for x in run_peer_script(
                peer_python(args, name), prompts, name, str(model_dir), *flags, "--lora-dirs",
                *map(str, adapters[r]), "--lora-counts", *map(str, args.lora_counts), "--max-lora-rank", str(r),
                every=True)]
        # Each peer's rows as they come: a later failure does not lose a run of many minutes.
        for row in rows:
            print(json.dumps(row), flush=True)
    for rank in [None, *args.ranks]:
        rows += run_jaxserve_apart(rank, adapters[rank] if rank else [])
    print("\n| engine | rank | adapters in use | output tok/s | vs the same engine without LoRA |")
    print("|---|---|---|---|---|")
    for row in rows:
        base = next(x for x in rows if x["engine"] == row["engine"] and x["rank"] is None)
        print(f"| {row['engine']} | {row['rank'] or 'no LoRA'} | {row['num_adapters']} | "
              f"{row['output_tokens_per_s']:.1f} | {row['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} |")


if __name__ == "__main__":
    main()
