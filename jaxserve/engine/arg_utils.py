"""EngineArgs: every engine setting, its default and its help, written once (vLLM's
``engine/arg_utils.py``).

``LLM(**kwargs)``, ``AsyncLLM.from_engine_args``, ``jaxserve generate`` and
``jaxserve serve`` all build their EngineConfig here::

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()

A field's CLI flag is its name with dashes; booleans get ``--x/--no-x``. Flags of the
front ends (host, port, prompt, ...) live with the front end, not here. A field's
default is the config dataclass field it becomes (jaxserve/config.py, where each
default is written once); the ones that depend on the model are None here and
resolved by ``create_engine_config``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import (
    DEFAULT_MAX_MODEL_LEN,
    CONVERTS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPES,
    RUNNERS,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    CacheConfig,
    LoRAConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    STRUCTURED_OUTPUTS_BACKENDS,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from jaxserve.core.sched.request_queue import SchedulingPolicy

logger = logging.getLogger("jaxserve")


def batch_invariant_env() -> bool:
    """Whether VLLM_BATCH_INVARIANT (vLLM's switch) asks for batch-invariant inference."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "yes")


def _attention_backends() -> tuple[str, ...]:
    from pallas_kernels.backend import BACKENDS

    return BACKENDS


def _quantization_methods() -> tuple[str, ...]:
    from models.quantization import KEPT_METHODS, QUANTIZATION_METHODS

    return QUANTIZATION_METHODS + KEPT_METHODS


def _reasoning_parsers() -> tuple[str, ...]:
    from jaxserve.reasoning import REASONING_PARSERS

    return tuple(sorted(REASONING_PARSERS))


def _arg(help: str, **cli) -> dict:
    """Field metadata: the CLI help text and extra argparse keywords (choices, flags)."""
    return {"help": help, **cli}


@dataclass(kw_only=True)
class EngineArgs:
    # ------------------------------------------------------------------ model
    model: str | None = field(default=None, metadata=_arg(
        "HF model folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)."))
    tokenizer: str | None = field(default=ModelConfig.tokenizer, metadata=_arg(
        "Tokenizer folder or id (default: the model's)."))
    served_model_name: str | None = field(default=None, metadata=_arg(
        "Model name in the API (default: the model argument, or SmolLM2-135M-Instruct)."))
    dtype: str = field(default=ModelConfig.dtype, metadata=_arg(
        "Weights / activation dtype (auto: float32 on CPU, bfloat16 on accelerators).", choices=DTYPES))
    weight_dtype: str = field(default=ModelConfig.weight_dtype, metadata=_arg(
        "Dtype of the matmul weights (projections, embedding, lm_head), multiplied with float32 accumulation "
        "(auto: --dtype's, except under --dtype auto on a CPU with AMX / AVX512-BF16: bfloat16 weights, "
        "float32 activations and KV cache).", choices=DTYPES))
    quantization: str | None = field(default=ModelConfig.quantization, metadata=_arg(
        "Weight-only quantization at load: int8 / fp8 (per-channel symmetric; projections only, the embedding, "
        "lm_head, norms and MoE router stay in --dtype); or awq / gptq / compressed-tensors / fp8 / mxfp4, "
        "the packed checkpoint's own format (int4, fp8 blocks, MXFP4 experts): its weights kept as stored and "
        "dequantized inside each product (the default on TPU / GPU; on CPU a packed checkpoint is otherwise "
        "decoded to floats at load).",
        choices=_quantization_methods, flags=("-q",)))
    max_model_len: int | None = field(default=None, metadata=_arg(
        f"Context length (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})."))
    seed: int = field(default=ModelConfig.seed, metadata=_arg("Seed for unseeded sampling."))
    max_logprobs: int = field(default=ModelConfig.max_logprobs, metadata=_arg("Most logprobs a request may ask for."))
    attention_backend: str = field(default=ModelConfig.attention_backend, metadata=_arg(
        "Attention implementation (auto: pallas on GPU/TPU; on CPU native, the C++ kernel built on first use, or "
        "reference where no compiler is found).", choices=_attention_backends))
    scan_layers: bool = field(default=ModelConfig.scan_layers, metadata=_arg(
        "Run the decoder layers under lax.scan (compile time flat in depth); --no-scan-layers unrolls them."))
    batch_invariant: bool = field(default=ModelConfig.batch_invariant, metadata=_arg(
        "Batch-invariant inference: a request's tokens and logprobs are bitwise the same whatever else shares "
        "its steps, how its prefill is chunked, its data-parallel rank or speculation (VLLM_BATCH_INVARIANT=1 "
        "turns it on too). Costs speed: docs/batch_invariance.md."))
    generation_config: str = field(default=ModelConfig.generation_config, metadata=_arg(
        "Where request sampling defaults come from: 'auto' (the model's generation_config.json), "
        "'vllm' (none: OpenAI's defaults) or a folder holding a generation_config.json."))
    override_generation_config: dict[str, Any] | None = field(
        default=ModelConfig.override_generation_config, metadata=_arg(
        'JSON object applied on top, e.g. \'{"temperature": 0.5, "max_new_tokens": 128}\'.'))
    runner: str = field(default="auto", metadata=_arg(
        "What the model is served for: generate (text), pooling (embeddings, classification, scores; "
        "docs/pooling.md), or auto (pooling for *ForSequenceClassification / *Model checkpoints).",
        choices=RUNNERS))
    convert: str = field(default="auto", metadata=_arg(
        "Under runner pooling: serve the model as an embedding model (embed) or a classifier (classify; "
        "needs a score head); auto: by the architecture.", choices=CONVERTS))
    pooler_config: dict[str, Any] | None = field(default=None, metadata=_arg(
        'Pooling settings as a JSON object, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
        "(keys: pooling_type LAST / CLS / MEAN, normalize, use_activation, dimensions)."))
    hf_overrides: dict[str, Any] | None = field(default=None, metadata=_arg(
        "JSON object applied on top of the model's config.json, vLLM's; e.g. a Qwen3-Reranker as a classifier: "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\' (docs/pooling.md).'))
    limit_mm_per_prompt: dict[str, Any] | None = field(default=None, metadata=_arg(
        'Vision-language models: the most images per prompt, as a JSON object like \'{"image": 4}\' (vLLM\'s; '
        "default 16)."))
    # ------------------------------------------------------------------ KV cache
    block_size: int = field(default=CacheConfig.block_size, metadata=_arg("KV cache block size in tokens."))
    enable_prefix_caching: bool = field(default=CacheConfig.enable_prefix_caching, metadata=_arg(
        "Reuse cached KV blocks of shared prefixes."))
    gpu_memory_utilization: float = field(default=CacheConfig.gpu_memory_utilization, metadata=_arg(
        "Fraction of device memory for weights + KV cache."))
    num_gpu_blocks_override: int | None = field(default=CacheConfig.num_gpu_blocks_override, metadata=_arg(
        "Use exactly this many KV blocks."))
    kv_cache_dtype: str = field(default=CacheConfig.cache_dtype, metadata=_arg(
        "KV cache dtype: auto (the activations'), bfloat16 (half of float32; the CPU's reference attention "
        "keeps the pages as their bit patterns), or fp8 / fp8_e4m3 (float8 e4m3 pages, "
        "half of bf16; widened in the attention kernel; not on TPU hardware).", choices=KV_CACHE_DTYPES))
    kv_cache_memory: int | None = field(default=CacheConfig.kv_cache_memory, metadata=_arg(
        "KV cache size in bytes (overrides the measured budget; the CPU default is 1 GiB)."))
    # ------------------------------------------------------------------ scheduler
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata=_arg("Requests running at once."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_arg(
        f"Token budget per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}; max_model_len without chunked "
        "prefill)."))
    enable_chunked_prefill: bool = field(default=SchedulerConfig.enable_chunked_prefill, metadata=_arg(
        "Split long prompts over several steps."))
    long_prefill_token_threshold: int = field(default=SchedulerConfig.long_prefill_token_threshold, metadata=_arg(
        "Most tokens one prefill takes per step (0: no cap)."))
    max_num_encoder_input_tokens: int = field(default=0, metadata=_arg(
        "Vision-language models: image tokens the vision tower encodes per step (0: max_num_batched_tokens, "
        "or the largest image's tokens if more)."))
    encoder_cache_size: int = field(default=0, metadata=_arg(
        "Vision-language models: image tokens the encoder-output cache holds (0: the encoder budget)."))
    scheduling_policy: str = field(default=SchedulerConfig.policy.value, metadata=_arg(
        "Order of the waiting queue.", choices=tuple(p.value for p in SchedulingPolicy)))
    async_scheduling: bool = field(default=SchedulerConfig.async_scheduling, metadata=_arg(
        "Schedule the next step while the device runs this one, and process this step's outputs while the "
        "next runs (host work off the critical path; a request that stops may compute one token in vain). "
        "Steps with grammar-constrained requests run synchronously; not with speculative decoding."))
    # ------------------------------------------------------------------ parallelism
    tensor_parallel_size: int = field(default=ParallelConfig.tensor_parallel_size, metadata=_arg(
        "Devices to shard the model over (any multiple or divisor of the KV heads; the vocabulary is padded).",
        flags=("-tp",)))
    data_parallel_size: int = field(default=ParallelConfig.data_parallel_size, metadata=_arg(
        "Model replicas, each with its own KV cache and scheduler; requests go to the least loaded.",
        flags=("-dp",)))
    enable_expert_parallel: bool = field(default=ParallelConfig.enable_expert_parallel, metadata=_arg(
        "MoE models: place whole experts on the tensor-parallel devices (num_experts / tp each) instead of "
        "splitting every expert's MLP over them."))
    distributed_coordinator_address: str | None = field(
        default=ParallelConfig.distributed_coordinator_address, metadata=_arg(
        "Multi-host: host:port of process 0 (jax.distributed); unset on one host and on TPU pods."))
    num_processes: int | None = field(default=ParallelConfig.num_processes, metadata=_arg(
        "Multi-host: processes in all."))
    process_id: int | None = field(default=ParallelConfig.process_id, metadata=_arg(
        "Multi-host: this process's index (0 runs the scheduler and the server; the others follow)."))
    # ------------------------------------------------------------------ structured outputs
    structured_outputs_backend: str = field(default=StructuredOutputsConfig.backend, metadata=_arg(
        "Grammar engine for constrained decoding (auto: xgrammar if installed, else llguidance; "
        "llguidance also takes what xgrammar cannot).", choices=STRUCTURED_OUTPUTS_BACKENDS))
    reasoning_parser: str | None = field(default=StructuredOutputsConfig.reasoning_parser, metadata=_arg(
        "The model's reasoning format: output up to </think> is reasoning_content, and a constraint applies "
        "after it.", choices=_reasoning_parsers))
    # ------------------------------------------------------------------ speculative decoding
    speculative_config: dict[str, Any] | None = field(default=EngineConfig.speculative_config, metadata=_arg(
        'Speculative decoding, vLLM\'s keys as a JSON object: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4}\'.'))
    # ------------------------------------------------------------------ LoRA
    enable_lora: bool = field(default=False, metadata=_arg(
        "Serve LoRA adapters (PEFT folders) on top of the model: a request names one (offline lora_request, the "
        "API's model field); adapters of a batch run together."))
    max_loras: int = field(default=LoRAConfig.max_loras, metadata=_arg(
        "Most distinct adapters in one step (device slots); requests of other adapters wait their turn."))
    max_lora_rank: int = field(default=LoRAConfig.max_lora_rank, metadata=_arg(
        "Largest adapter rank served (every slot has this rank; smaller adapters are zero padded).",
        choices=LORA_RANKS))
    max_cpu_loras: int | None = field(default=LoRAConfig.max_cpu_loras, metadata=_arg(
        "Adapters kept in host memory, least recently used dropped first (default: max_loras; at least that)."))
    # ------------------------------------------------------------------ observability
    otlp_traces_endpoint: str | None = field(default=ObservabilityConfig.otlp_traces_endpoint, metadata=_arg(
        "Send one OpenTelemetry span per request (vLLM's attributes: queue, prefill, decode times, tokens) to "
        "this OTLP collector (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, the default, or http/protobuf). Needs "
        "pip install 'jaxserve[otel]'."))
    # ------------------------------------------------------------------ compilation
    enforce_eager: bool = field(default=EngineConfig.enforce_eager, metadata=_arg(
        "Skip the start-up warm-up (compile on demand)."))
    background_warmup: bool = field(default=EngineConfig.background_warmup, metadata=_arg(
        "Start serving once the programs of the smallest steps are compiled and compile the others on a "
        "thread, smallest first; until then steps hold fewer tokens (long prompts take more chunks). "
        "Default on for `serve`. Not with speculative decoding, multi-host or without chunked prefill."))
    token_buckets: list[int] | None = field(default=EngineConfig.token_buckets, metadata=_arg(
        "Padded token counts the step compiles for (default: powers of two from 16 up to "
        "max_num_batched_tokens; from 1 on a CPU)."))
    request_buckets: list[int] | None = field(default=EngineConfig.request_buckets, metadata=_arg(
        "Padded request counts the sampler compiles for (default: powers of two from 8 up to max_num_seqs, "
        "and 1 on a CPU)."))

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field (the model also as an optional positional argument)."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine arguments")
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flags = (f"--{f.name.replace('_', '-')}", *meta.pop("flags", ()))
            help_text = meta.pop("help")
            if callable(meta.get("choices")):
                meta["choices"] = meta["choices"]()
            kind = _base_type(hints[f.name])
            if f.name == "model":
                group.add_argument("model", nargs="?", default=None, help=help_text)
                group.add_argument("--model", dest="model_option", default=None, help=argparse.SUPPRESS)
                continue
            if kind is bool:
                meta["action"] = argparse.BooleanOptionalAction
            elif kind is list:
                meta.update(type=int, nargs="+")
            elif kind is dict:
                meta["type"] = _json_object
            else:
                meta["type"] = kind
            default = f.default
            if default is not None and kind is not bool:
                help_text = f"{help_text.rstrip('.')} (default: {default})."
            group.add_argument(*flags, dest=f.name, default=default, help=help_text, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if values.get("model") is None:
            values["model"] = getattr(args, "model_option", None)
        return cls(**values)

    # ------------------------------------------------------------------ config
    def _image_limit(self) -> int:
        """--limit-mm-per-prompt's image count (ValueError for another modality)."""
        limits = self.limit_mm_per_prompt or {}
        unknown = set(limits) - {"image"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: only 'image' is supported, got {sorted(unknown)}")
        n = limits.get("image", ModelConfig.limit_mm_per_prompt)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt: 'image' must be an integer >= 0, got {n!r}")
        return n

    def create_engine_config(self, *, progress: bool = True,
                             default_max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> EngineConfig:
        """Resolve the model (converting a GGUF once), fill the defaults that depend on
        it and validate everything (ValueError naming the setting).
        ``default_max_model_len`` caps the model's own limit when max_model_len is unset."""
        from jaxserve.engine.model_resolver import resolve_model_path
        from models.config import ModelArchConfig
        from models.default_model import DEFAULT_MODEL_NAME

        from jaxserve.engine.pooler_resolver import resolve_hf_overrides, resolve_pooler_config

        from models.registry import ENCODER_ARCHITECTURES

        path = resolve_model_path(self.model, progress=progress)
        hf_overrides = resolve_hf_overrides(path, self.tokenizer, self.hf_overrides)
        arch = ModelArchConfig.from_pretrained(path, hf_overrides)
        pooler_config = resolve_pooler_config(path, arch.architecture, self.runner, self.convert, self.pooler_config,
                                              hf_overrides)
        model_limit = arch.max_position_embeddings
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(model_limit, default_max_model_len)
        elif max_model_len > model_limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {model_limit} positions")
        # An encoder attends both ways: its whole prompt runs in one step (no chunks), and
        # its KV cache is never used (so no prefix cache either).
        encoder = arch.architecture in ENCODER_ARCHITECTURES
        chunked_prefill = self.enable_chunked_prefill and not encoder
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked_prefill else max(
                max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS if encoder else 0)
        if encoder and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 does not work with an encoder (BERT-family) model yet")
        if encoder and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: an encoder runs a whole prompt in one "
                             f"step, so it must be at least max_model_len={max_model_len}")
        model_config = ModelConfig(
            model=path, tokenizer=self.tokenizer, dtype=self.dtype, weight_dtype=self.weight_dtype, seed=self.seed,
            served_model_name=self.served_model_name or self.model or DEFAULT_MODEL_NAME,
            max_logprobs=self.max_logprobs, attention_backend=self.attention_backend, scan_layers=self.scan_layers,
            generation_config=self.generation_config, override_generation_config=self.override_generation_config,
            quantization=self.quantization, batch_invariant=self.batch_invariant or batch_invariant_env(),
            pooler_config=pooler_config, hf_overrides=hf_overrides,
            limit_mm_per_prompt=self._image_limit())
        encoder_budget = self.max_num_encoder_input_tokens
        if arch.vision is not None and not encoder_budget:
            from jaxserve.multimodal.processor import MultiModalProcessor

            # vLLM's default: the step's token budget, or the largest image if that is more.
            largest = MultiModalProcessor.from_model(path, arch).max_tokens_per_image
            encoder_budget = max(max_num_batched_tokens, largest)
        if arch.mm_bidirectional:
            # An image goes into one chunk whole (disable_chunked_mm_input): it must fit one.
            image_tokens = arch.vision.tokens_per_image
            for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                                ("long_prefill_token_threshold", self.long_prefill_token_threshold)):
                if value and value < image_tokens:
                    raise ValueError(f"{name} ({value}) must be at least {image_tokens}: this model's images "
                                     f"({image_tokens} tokens each) attend within themselves both ways, so each "
                                     "is prefilled in one chunk")
        defaults = model_config.get_diff_sampling_param()
        if defaults:
            logger.info("Sampling defaults from the model's generation config: %s (a request's own values win; "
                        "generation_config='vllm' ignores them)", defaults)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                # MEAN / CLS need every token's hidden state: a cached prefix would skip them.
                enable_prefix_caching=self.enable_prefix_caching and not encoder and (
                    pooler_config is None or pooler_config.pooling_type == "LAST"),
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override, kv_cache_memory=self.kv_cache_memory,
                cache_dtype=self.kv_cache_dtype),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len, enable_chunked_prefill=chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling, max_num_encoder_input_tokens=encoder_budget,
                encoder_cache_size=max(self.encoder_cache_size, encoder_budget),
                disable_chunked_mm_input=arch.mm_bidirectional),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                distributed_coordinator_address=self.distributed_coordinator_address,
                num_processes=self.num_processes, process_id=self.process_id),
            structured_outputs_config=StructuredOutputsConfig(
                backend=self.structured_outputs_backend, reasoning_parser=self.reasoning_parser),
            speculative_config=(SpeculativeConfig.from_dict(self.speculative_config)
                                if self.speculative_config is not None else None),
            lora_config=(LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                                    max_cpu_loras=self.max_cpu_loras) if self.enable_lora else None),
            observability_config=ObservabilityConfig(otlp_traces_endpoint=self.otlp_traces_endpoint),
            enforce_eager=self.enforce_eager,
            background_warmup=self.background_warmup,
            token_buckets=tuple(self.token_buckets) if self.token_buckets else None,
            request_buckets=tuple(self.request_buckets) if self.request_buckets else None,
        )


def _base_type(hint) -> type:
    """int | None -> int; list[int] | None -> list; dict[str, Any] | None -> dict."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
