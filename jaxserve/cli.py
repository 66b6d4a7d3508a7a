"""`jaxserve serve | generate | convert`."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from jaxserve.engine.arg_utils import EngineArgs
from server.cli_serve import add_serve_parser


# `generate` answers one prompt: without --max-model-len its context stops here, so the
# KV cache of a 7-8B model in f32 fits the CPU's default 1 GiB.
GENERATE_MAX_MODEL_LEN = 2048


def _generate(args) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args), default_max_model_len=GENERATE_MAX_MODEL_LEN)
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
    # The format follows the input unless --format says: a .gguf file becomes an HF-style
    # folder (its only other form); anything else a model argument names becomes orbax.
    fmt = args.format or ("hf" if args.model.endswith(".gguf") else "orbax")
    if fmt == "hf":
        if not args.model.endswith(".gguf"):
            raise ValueError("--format hf converts a .gguf file; an HF model folder is already that format")
        if args.dtype != "auto":
            raise ValueError("--dtype applies to --format orbax (a GGUF import writes float32)")
        from models.gguf_import import convert_gguf_to_hf

        out = convert_gguf_to_hf(args.model, args.out_dir, overwrite=args.overwrite)
    else:
        from jaxserve.engine.model_resolver import resolve_model_path
        from models.checkpoint import convert_to_orbax

        # Any model `serve` accepts (folder, .gguf, hub id); a .gguf goes through its cached HF folder.
        source = resolve_model_path(args.model)
        out = convert_to_orbax(source, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"Converted {args.model} -> {out} ({fmt})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="vLLM's V1 engine on JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one answer offline")
    EngineArgs.add_cli_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="plain completion (no chat template)")
    g.set_defaults(func=_generate)

    c = sub.add_parser("convert", help="convert a GGUF file into an HF-style folder, or a model into an "
                                       "orbax folder (serve it like any model folder; restores fast)")
    c.add_argument("model", help="a .gguf file, or (orbax) a model folder, .gguf file or hub id")
    c.add_argument("out_dir")
    c.add_argument("--format", choices=("hf", "orbax"), default=None,
                   help="hf: GGUF -> HF-style folder; orbax: the serving params as an orbax checkpoint "
                        "(default: hf for a .gguf file, orbax otherwise)")
    c.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"), default="auto",
                   help="orbax: the stored params' dtype (auto: the checkpoint's own); serving casts to its own")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_convert)

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
