"""Embedding throughput (issue 33): a decoder embedder of Qwen3-Embedding-0.6B's shape
(random weights, HF's Qwen3Model layout, last-token pooling, normalized; --size 0.6b) or
a BERT-base-sized encoder (bert-base / e5-base's shape, mean pooling, normalized;
--size bert-base) through
jaxserve's pooling runner, sentence-transformers (torch CPU) and vLLM's CPU build
(--peer-python), each engine in a process of its own, each at its defaults (vLLM:
bfloat16 on x86; jaxserve: bf16 matmul weights where the CPU multiplies bf16 natively;
sentence-transformers: float32), on the same token ids: sequences/s and tokens/s per
(batch, length) cell (one timed call; the median of 3 at batch 1), and each engine's embeddings against sentence-transformers' float32
ones (the lowest cosine).

    python benchmarks/bench_embeddings.py
    python benchmarks/bench_embeddings.py --peer-python ../vllm-venv/bin/python --cells 1x16 32x128 256x16
    python benchmarks/bench_embeddings.py --size bert-base --peer-python ../vllm-venv/bin/python

The script runs itself as the worker of each engine (--worker ENGINE): the worker
imports only what its engine needs, so vLLM's environment needs nothing of jaxserve.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CELLS = ("1x16", "1x512", "32x128", "256x16", "32x512")
SIZES = {  # Qwen3-Embedding-0.6B's shape; "tiny" for a quick check of the script
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151669),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
    # BERT-base (bge-base / e5-base / all-mpnet-sized encoders): an encoder, not a decoder.
    "bert-base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      vocab_size=30522, type_vocab_size=2),
    "bert-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=512, type_vocab_size=2),
}
ENCODERS = ("bert-base", "bert-tiny")


def make_model(out: Path, size: str) -> Path:
    """A random Qwen3Model with a word-level tokenizer ("w3 w4 ..." is ids 3, 4, ...) and
    a sentence-transformers layout (last token, Normalize)."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
    from hf_factory import _write_tokenizer

    torch.manual_seed(0)
    if size in ENCODERS:  # BertModel, 512 positions, mean pooling (e5 / all-MiniLM style)
        cfg = transformers.BertConfig(**SIZES[size], max_position_embeddings=512, pad_token_id=0)
        transformers.BertModel(cfg, add_pooling_layer=False).float().eval().save_pretrained(out)
    else:
        cfg = transformers.Qwen3Config(**SIZES[size], max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                       pad_token_id=0, tie_word_embeddings=True)
        transformers.Qwen3Model(cfg).float().eval().save_pretrained(out)
        # As Qwen3-Embedding ships: config.json names Qwen3ForCausalLM over Qwen3Model's tensors.
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    _write_tokenizer(out, SIZES[size]["vocab_size"])
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    pooling = "pooling_mode_mean_tokens" if size in ENCODERS else "pooling_mode_lasttoken"
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": SIZES[size]["hidden_size"], pooling: True}))
    return out


def cells_prompts(cells, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    return {c: [rng.integers(3, vocab, int(c.split("x")[1])).tolist() for _ in range(int(c.split("x")[0]))]
            for c in cells}


# ------------------------------------------------------------------ workers (one engine each)
def worker(engine: str, model: str, prompts_file: str, max_len: int) -> None:
    cells = json.loads(Path(prompts_file).read_text())
    t0 = time.perf_counter()
    if engine == "jaxserve":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from jaxserve import LLM

        llm = LLM(model, max_model_len=max_len, progress=False)
        version = "jaxserve"
        run = lambda ps: [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in ps],  # noqa: E731
                                                                  use_tqdm=False)]
    elif engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        import vllm

        encoder = json.loads((Path(model) / "config.json").read_text())["architectures"] == ["BertModel"]
        llm = vllm.LLM(model=model, runner="pooling", max_model_len=max_len, seed=0,
                       **({} if encoder else {"convert": "embed"}))
        version = f"vllm {vllm.__version__}"
        run = lambda ps: [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in ps],  # noqa: E731
                                                                  use_tqdm=False)]
    else:  # sentence-transformers, float32, batches of the cell's size
        import sentence_transformers
        import torch

        torch.set_num_threads(os.cpu_count())
        st = sentence_transformers.SentenceTransformer(model, device="cpu")
        st.tokenizer.pad_token = "<unk>"  # a cell's prompts are of one length: nothing is padded
        version = f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}"
        run = lambda ps: st.encode([" ".join(f"w{t}" for t in p) for p in ps],  # noqa: E731
                                   batch_size=len(ps)).tolist()
    startup = time.perf_counter() - t0
    for cell, ps in cells.items():
        # Warm (first calls of a shape: torch's allocator, vLLM's profiling) on other prompts of
        # the cell's length: the timed ones must not be in a prefix cache already.
        run([p[::-1] for p in ps[:2]])
        # A batch-1 call is short (tens of ms): the median of 3, each on prompts of its
        # own (rotated: no prefix-cache hit), the first the ones compared for quality.
        times = []
        for r in range(3 if len(ps) == 1 else 1):
            t0 = time.perf_counter()
            out = run([p[r:] + p[:r] for p in ps])
            times.append(time.perf_counter() - t0)
            vecs = out if r == 0 else vecs
        dt = float(np.median(times))
        print(json.dumps({"engine": engine, "version": version, "startup_s": round(startup, 1), "cell": cell,
                          "seconds": dt, "seqs_per_s": len(ps) / dt, "tokens_per_s": sum(map(len, ps)) / dt,
                          "sample": np.asarray(vecs[:4], np.float32).tolist()}), flush=True)


def run_worker(python: str, engine: str, model: Path, prompts_file: str, max_len: int) -> list[dict]:
    cmd = [python, __file__, "--worker", engine, "--model", str(model), "--prompts", prompts_file,
           "--max-model-len", str(max_len)]
    print(f"Running {engine}: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        print(f"{engine} failed (exit {done.returncode}); its rows are missing", flush=True)
    out = done.stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"engine"')]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="0.6b")
    p.add_argument("--cells", nargs="+", default=list(CELLS), help="BATCHxLENGTH cells")
    p.add_argument("--engines", nargs="*", default=["sentence-transformers", "jaxserve"])
    p.add_argument("--peer-python", help="Python of vLLM's CPU build (adds the vllm engine)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.prompts, args.max_model_len)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import commit_line, machine_line

    print(machine_line(), flush=True)
    print(commit_line(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_emb_"))
    print(f"Building a random {args.size} {'BERT' if args.size in ENCODERS else 'Qwen3'} embedder in {tmp} ...",
          flush=True)
    model = make_model(tmp / "model", args.size)
    prompts_file = str(tmp / "prompts.json")
    Path(prompts_file).write_text(json.dumps(cells_prompts(args.cells, SIZES[args.size]["vocab_size"])))
    rows = []
    engines = [(e, sys.executable) for e in args.engines] + ([("vllm", args.peer_python)] if args.peer_python else [])
    for engine, python in engines:
        rows += run_worker(python, engine, model, prompts_file, args.max_model_len)
    ref = {r["cell"]: np.asarray(r["sample"]) for r in rows if r["engine"] == "sentence-transformers"}
    print("\n| engine | batch x length | seqs/s | tokens/s | min cosine vs sentence-transformers f32 |")
    print("|---|---|---|---|---|")
    for r in rows:
        cos = "-"
        if r["cell"] in ref and r["engine"] != "sentence-transformers":
            a, b = np.asarray(r["sample"]), ref[r["cell"]]
            cos = f"{float(np.min(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))):.5f}"
        print(f"| {r['engine']} | {r['cell']} | {r['seqs_per_s']:.2f} | {r['tokens_per_s']:.0f} | {cos} |")
    for e in dict.fromkeys(r["engine"] for r in rows):
        r = next(x for x in rows if x["engine"] == e)
        print(f"{e}: {r['version']}, start-up {r['startup_s']} s")


if __name__ == "__main__":
    main()
