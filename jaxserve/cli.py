"""`jaxserve serve | generate | convert`."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (default: measured)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])


def _generate(args) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    # One short answer: a 2048-token default keeps the KV cache of a 7-8B model in f32
    # within the CPU's default 1 GiB (--max-model-len raises it, up to the model's limit).
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, default_max_model_len=2048,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
              num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, attention_backend=args.attention_backend)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p,
                            seed=args.sampling_seed)
    has_template = getattr(llm.tokenizer, "chat_template", None)
    if args.raw or not has_template:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _convert(args) -> int:
    from models.gguf_import import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf_file, args.out_dir, overwrite=args.overwrite)
    print(f"Converted {args.gguf_file} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="vLLM's V1 engine on JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one answer offline")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="plain completion (no chat template)")
    g.set_defaults(func=_generate)

    c = sub.add_parser("convert", help="convert a GGUF file into an HF-style folder")
    c.add_argument("gguf_file")
    c.add_argument("out_dir")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_convert)

    try:
        from server.cli_serve import add_serve_parser
    except ImportError:  # the server package is optional in stripped installs
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
