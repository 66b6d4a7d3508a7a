"""Offline throughput of a peer engine on given token-id prompts (run by
bench_throughput.py --peer, in the peer's own Python environment: it imports nothing
from jaxserve).

    python benchmarks/peer_throughput.py --engine vllm --model DIR --prompts prompts.json --output-len 64

Prints one JSON line: engine, version, startup_s, elapsed_s, prompt/output token counts
(with --greedy, vllm: each prompt's greedy output ids and logprobs instead).
Every engine: greedy, EOS ignored, exactly --output-len new tokens per prompt.
  vllm:     vllm.LLM (the CPU build: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND), one generate call.
  hf:       transformers generate, left-padded batches of --batch-size, torch CPU.
  llamacpp: llama-cpp-python on a GGUF file (--model), one prompt at a time (its API has no batch).
With --lora-dirs (vllm): one engine with --enable-lora (max_loras = the adapters, --max-lora-rank),
timed once per --lora-counts value, the prompts' adapters taken in turn from the first that many
(0: the base model on the LoRA engine); prints one JSON line per count, with "num_adapters".
"""
from __future__ import annotations

import argparse
import json
import os
import time


def vllm_llm(args):
    """vllm.LLM on --model at --dtype, the CPU build's KV space and thread binding set
    unless given."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from vllm import LLM

    lora = {}
    if args.lora_dirs:
        lora = dict(enable_lora=True, max_loras=len(args.lora_dirs), max_lora_rank=args.max_lora_rank,
                    max_cpu_loras=len(args.lora_dirs))
    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
               max_num_seqs=args.batch_size, enable_prefix_caching=not args.no_prefix_caching, **lora)


def run_vllm_lora(args, prompts) -> list[dict]:
    """--lora-dirs: one LoRA engine, timed with 0 / 1 / ... adapters in use (--lora-counts)."""
    t0 = time.perf_counter()
    llm = vllm_llm(args)
    import vllm
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    startup = time.perf_counter() - t0
    loras = [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(args.lora_dirs)]
    # Every adapter read once before the clock (the first request of an adapter loads it).
    llm.generate([{"prompt_token_ids": prompts[0]}] * len(loras), SamplingParams(max_tokens=2), lora_request=loras,
                 use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for count in args.lora_counts:
        chosen = [loras[i % count] if count else None for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=chosen, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"engine": "vllm", "version": vllm.__version__, "startup_s": startup, "elapsed_s": elapsed,
                     "prompt_tokens": sum(map(len, prompts)), "output_tokens": produced,
                     "output_tokens_per_s": produced / elapsed, "num_adapters": count,
                     "dtype": str(llm.llm_engine.model_config.dtype)})
    return rows


def run_vllm(args, prompts):
    t0 = time.perf_counter()
    llm = vllm_llm(args)
    import vllm
    from vllm import SamplingParams

    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return vllm.__version__, startup, elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_vllm_greedy(args, prompts):
    """--greedy: each prompt's greedy output (EOS respected) with its tokens' logprobs, for
    agreement with a reference (bench_quantization.py --peer)."""
    llm = vllm_llm(args)
    import vllm
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        results.append({"ids": ids, "logprobs": [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]})
    return {"engine": "vllm", "version": vllm.__version__, "dtype": str(llm.llm_engine.model_config.dtype),
            "outputs": results}


def run_hf(args, prompts):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    t0 = time.perf_counter()
    # auto: the checkpoint's dtype (transformers' own default).
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    startup = time.perf_counter() - t0
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    t0 = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i:i + args.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, pad_token_id=pad)
            produced += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - t0
    return transformers.__version__, startup, elapsed, produced


def run_llamacpp(args, prompts):
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.max_model_len, n_threads=os.cpu_count(),
                          n_batch=512, verbose=False)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    produced = 0
    for p in prompts:
        llm.reset()
        for n, _ in enumerate(llm.generate(p, temp=0.0, reset=True), 1):
            if n == args.output_len:
                break
        produced += n
    elapsed = time.perf_counter() - t0
    return llama_cpp.__version__, startup, elapsed, produced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("vllm", "hf", "llamacpp"), required=True)
    ap.add_argument("--model", required=True, help="an HF folder (vllm, hf) or a GGUF file (llamacpp)")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", help="auto: the engine's own default")
    ap.add_argument("--lora-dirs", nargs="+", default=[], help="vllm only: PEFT adapter folders (see above)")
    ap.add_argument("--lora-counts", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="vllm only: prefix caching off (runs that repeat prompts then all start cold)")
    ap.add_argument("--greedy", action="store_true",
                    help="vllm only: print each prompt's greedy output and its logprobs instead of timing")
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    if args.greedy:
        if args.engine != "vllm":
            raise SystemExit("--greedy is implemented for --engine vllm")
        print(json.dumps(run_vllm_greedy(args, prompts)))
        return
    if args.lora_dirs:
        if args.engine != "vllm":
            raise SystemExit("--lora-dirs is implemented for --engine vllm")
        for row in run_vllm_lora(args, prompts):
            print(json.dumps(row))
        return
    runner = {"vllm": run_vllm, "hf": run_hf, "llamacpp": run_llamacpp}[args.engine]
    version, startup, elapsed, produced = runner(args, prompts)
    print(json.dumps({"engine": args.engine, "version": version, "startup_s": startup, "elapsed_s": elapsed,
                      "prompt_tokens": sum(map(len, prompts)), "output_tokens": produced,
                      "output_tokens_per_s": produced / elapsed}))


if __name__ == "__main__":
    main()
