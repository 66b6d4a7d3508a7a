"""`jaxserve serve`: argparse setup and the entry point that starts the server.

jaxserve/cli.py wires it in::

    from server.cli_serve import add_serve_parser, run_serve
    add_serve_parser(subparsers)          # sets args.func = run_serve
    ...
    args.func(args)

``python -m server.cli_serve [serve] [MODEL] [options]`` runs it standalone.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger("jaxserve")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand (vLLM's argument names) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (vLLM's argument names).")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="Host to bind (default: %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="Port to bind (default: %(default)s).")
    p.add_argument("--served-model-name", default=None,
                   help="Model name in the API (default: the MODEL argument, or SmolLM2-135M-Instruct).")
    p.add_argument("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 routes.")
    p.add_argument("--tokenizer", default=None, help="Tokenizer folder or id (default: the model's).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="Weights / activation dtype (auto: float32 on CPU, bfloat16 on accelerators).")
    p.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's, at most 8192).")
    p.add_argument("--max-num-seqs", type=int, default=64, help="Requests running at once (default: %(default)s).")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Token budget per step (default: 2048).")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default: %(default)s).")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="Reuse cached KV blocks of shared prefixes (default: on).")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="Fraction of device memory for weights + KV cache (default: %(default)s).")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="Use exactly this many KV blocks.")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV cache size in bytes (overrides the measured budget; needed on CPU for other than 1 GiB).")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Devices to shard the model over.")
    p.add_argument("--seed", type=int, default=0, help="Seed for unseeded sampling (default: %(default)s).")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"],
                   help="Attention implementation (auto: pallas on GPU/TPU, reference on CPU).")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="Most logprobs a request may ask for (default: %(default)s).")
    p.add_argument("--generation-config", default="auto",
                   help="Where request sampling defaults come from: 'auto' (the model's generation_config.json), "
                        "'vllm' (none: OpenAI's defaults) or a folder holding a generation_config.json.")
    p.add_argument("--override-generation-config", type=_json_object, default=None,
                   help='JSON object applied on top, e.g. \'{"temperature": 0.5, "max_new_tokens": 128}\'.')
    p.add_argument("--enforce-eager", action="store_true", help="Skip the start-up warm-up (compile on demand).")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="Report usage.prompt_tokens_details.cached_tokens.")
    p.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run_serve)
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run_serve(args: argparse.Namespace) -> None:
    """Build the engine (vLLM's argument names), warm it up, serve until interrupted."""
    import uvicorn

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.llm import build_engine_config, enable_compilation_cache
    from models.default_model import DEFAULT_MODEL_NAME
    from server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model if args.model is not None else getattr(args, "model_opt", None)
    enable_compilation_cache()
    config = build_engine_config(
        model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory=args.kv_cache_memory, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs, attention_backend=args.attention_backend,
        served_model_name=args.served_model_name, enforce_eager=args.enforce_eager,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
    )
    name = args.served_model_name or config.model_config.served_model_name or model or DEFAULT_MODEL_NAME
    async_llm = AsyncLLM(config)
    logger.info("Engine ready in %.1f s (warm-up %.1f s)", async_llm.engine.startup_seconds,
                async_llm.engine.engine_core.warmup_seconds)
    app = build_app(async_llm, name, api_key=args.api_key, max_model_len=config.scheduler_config.max_model_len,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    disable_log_requests=args.disable_log_requests)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_keep_alive=5)
    finally:
        async_llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    parser = argparse.ArgumentParser(prog="jaxserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
