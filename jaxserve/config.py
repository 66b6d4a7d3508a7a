"""Engine configuration: frozen keyword-only dataclasses, validated on construction.

Every setting's default is written once, here, in the field that holds it; EngineArgs
(engine/arg_utils.py: the flags, their help, what LLM(...) and the CLIs take) reads
its defaults from these fields, as vLLM's EngineArgs does. The two that depend on
the model are None there and resolved by EngineArgs.create_engine_config:
max_model_len (the model's own limit, at most DEFAULT_MAX_MODEL_LEN) and
max_num_batched_tokens (DEFAULT_MAX_NUM_BATCHED_TOKENS, or max_model_len without
chunked prefill); the fields below default to those same constants.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxserve.core.sched.request_queue import SchedulingPolicy

# generation_config.json fields that become request defaults, as vLLM's
# `--generation-config auto` reads them (max_new_tokens is HF's name for max_tokens).
GENERATION_CONFIG_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                                     "max_new_tokens")
# Serving dtypes by name (auto: float32 on CPU, bfloat16 on accelerators); the runner
# maps them to jnp dtypes.
DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half")

# Without --max-model-len: the model's own limit, at most this (a 128k-context model
# would otherwise size every per-request array and the KV budget for 128k tokens).
DEFAULT_MAX_MODEL_LEN = 8192
# The token budget per step with chunked prefill (without it: max_model_len).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# AsyncLLM's iteration timeout (`serve --engine-iteration-timeout`): a step running
# longer kills the engine (a hung device or collective), so requests in flight fail
# instead of waiting for ever. Far above any real step, compiles included.
DEFAULT_ITERATION_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 64
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # the one home of the context length (EngineArgs resolves it)
    enable_chunked_prefill: bool = True
    # 0: no cap. Otherwise a prefill takes at most this many tokens per step, so one
    # long prompt cannot starve the others (vLLM's long_prefill_token_threshold).
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # vLLM's --async-scheduling: step N + 1 is scheduled while step N runs on the device.
    async_scheduling: bool = False
    # Vision-language models: the image tokens the vision tower may encode per step, and
    # the rows of the encoder-output buffer (vLLM's max_num_encoder_input_tokens and
    # encoder_cache_size); 0: max_num_batched_tokens, and the encoder budget (vLLM's defaults).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # vLLM's disable_chunked_mm_input: a chunk never ends inside an image (it stops before
    # the image instead). On for models whose image tokens attend to each other both ways
    # (Gemma 3): the image's later tokens must be in the step that computes its first.
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: max_num_batched_tokens), got {getattr(self, name)}")
        if self.encoder_cache_rows < self.encoder_budget:
            raise ValueError(f"encoder_cache_size ({self.encoder_cache_rows}) must be >= "
                             f"max_num_encoder_input_tokens ({self.encoder_budget})")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled: a whole prompt must fit in one step"
            )
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))

    @property
    def encoder_budget(self) -> int:
        """Image tokens the vision tower may encode per step."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_cache_rows(self) -> int:
        """Rows (image tokens) of the encoder-output buffer (0: the encoder budget)."""
        return self.encoder_cache_size or self.encoder_budget


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None  # bytes; overrides the measured budget
    cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8 e4m3 pages

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.cache_dtype!r}")
        if self.block_size < 1 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (the null block and one usable block)")


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The ('data', 'model') mesh: data_parallel_size ranks, each with its own KV cache
    and scheduler, times tensor_parallel_size devices per rank (docs/design.md §5); and, for
    multi-host (JAX multi-controller), how this process joins the others."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # MoE experts whole on each 'model' device (E / tp each) instead of split by their
    # mlp dim (models/moe.py).
    enable_expert_parallel: bool = False
    # Multi-host: all None on one host (and on a TPU pod slice, where JAX finds them).
    distributed_coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1):
            raise ValueError(f"process_id must be in [0, num_processes), got {self.process_id} "
                             f"with num_processes={self.num_processes}")


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "CLS", "MEAN")


@dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into its output (vLLM's
    --pooler-config; docs/pooling.md). The defaults are request defaults: a request's
    PoolingParams may override normalize / use_activation / dimensions."""

    task: str  # "embed" or "classify": what the model is served as
    pooling_type: str = "LAST"  # one of POOLING_TYPES: the last token, the first, or the mean
    normalize: bool = True  # embed: L2-normalize the output
    use_activation: bool = True  # classify: softmax over the labels (sigmoid for one label)
    dimensions: int | None = None  # embed: default Matryoshka truncation (None: all)
    # Matryoshka models (config.json is_matryoshka / matryoshka_dimensions): only they take dimensions.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0  # classify: the score head's outputs

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"pooler_config: task must be 'embed' or 'classify', got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config: dimensions must be at least 1, got {self.dimensions}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    model: str  # local folder (HF layout)
    tokenizer: str | None = None
    dtype: str = "auto"  # one of DTYPES
    # The matmul weights' dtype, one of DTYPES (auto: dtype's, or bfloat16 under dtype=auto
    # on a CPU with native bf16 products; jaxserve/runner/dtypes.py).
    weight_dtype: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    max_logprobs: int = 20
    attention_backend: str = "auto"
    scan_layers: bool = True  # decoder layers under lax.scan; False unrolls them
    # "auto": the model folder's generation_config.json supplies sampling defaults;
    # "vllm": none (vLLM's own defaults); a folder path: that folder's file.
    generation_config: str = "auto"
    # Applied on top of the file: e.g. {"temperature": 0.5, "max_new_tokens": 128}.
    override_generation_config: dict[str, Any] | None = None
    quantization: str | None = None  # weight-only "int8" (models/quantization.py); None: as stored
    # Every row's tokens and logprobs independent of the step's other rows, its bucket,
    # chunking, data-parallel rank and speculation (docs/batch_invariance.md).
    batch_invariant: bool = False
    # None: a generative model; else the pooling runner serves it (docs/pooling.md).
    pooler_config: PoolerConfig | None = None
    # Applied on top of the model's config.json (vLLM's --hf-overrides), with
    # classifier_from_token resolved to classifier_from_token_ids by the engine args.
    hf_overrides: dict[str, Any] | None = None
    # Vision-language models: the most images one prompt may carry (vLLM's
    # --limit-mm-per-prompt '{"image": N}').
    limit_mm_per_prompt: int = 16

    def __post_init__(self) -> None:
        if self.limit_mm_per_prompt < 0:
            raise ValueError(f"limit_mm_per_prompt must be >= 0, got {self.limit_mm_per_prompt}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.weight_dtype not in DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(DTYPES)}; got {self.weight_dtype!r}")
        from models.quantization import check_quantization

        check_quantization(self.quantization)
        gc = self.generation_config
        if gc not in ("auto", "vllm") and not Path(gc).expanduser().is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {gc!r}")
        unknown = set(self.override_generation_config or {}) - set(GENERATION_CONFIG_SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"override_generation_config: unknown field(s) {sorted(unknown)}; "
                             f"allowed: {list(GENERATION_CONFIG_SAMPLING_FIELDS)}")

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults recommended by the model's creator (vLLM's name).

        Keys are SamplingParams field names (max_new_tokens becomes max_tokens); a
        request's own values always win. Empty with generation_config="vllm" and no
        overrides, or when the file has none of the sampling fields.
        """
        config: dict[str, Any] = {}
        if self.generation_config != "vllm":
            folder = self.model if self.generation_config == "auto" else self.generation_config
            path = Path(folder).expanduser() / "generation_config.json"
            if path.is_file():
                # The raw file, not transformers' GenerationConfig: that one drops values
                # equal to its own defaults (e.g. an explicit top_k of 50).
                config = json.loads(path.read_text(encoding="utf-8"))
        config.update(self.override_generation_config or {})
        out = {k: config[k] for k in GENERATION_CONFIG_SAMPLING_FIELDS if config.get(k) is not None}
        if "max_new_tokens" in out:
            out["max_tokens"] = out.pop("max_new_tokens")
        return out


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "llguidance")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding (vLLM's StructuredOutputsConfig).

    backend: "xgrammar", "guidance" (llguidance; "llguidance" is an alias) or "auto":
    xgrammar when it is installed (it needs torch), else llguidance; a request whose
    grammar xgrammar cannot handle falls back to llguidance.
    reasoning_parser: the model's reasoning format (jaxserve/reasoning); a constraint
    applies only once the reasoning has ended, and the server splits it off as
    ``reasoning_content``."""

    backend: str = "auto"
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}; "
                             f"got {self.backend!r}")
        if self.backend == "llguidance":
            object.__setattr__(self, "backend", "guidance")
        if self.reasoning_parser is not None:
            from jaxserve.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}; "
                                 f"got {self.reasoning_parser!r}")


@dataclass(frozen=True, kw_only=True)
class ObservabilityConfig:
    """Request tracing (vLLM's ObservabilityConfig; jaxserve/tracing.py):
    ``otlp_traces_endpoint`` is the OTLP collector that gets one span per request
    (None: no tracing)."""

    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.otlp_traces_endpoint is not None:
            from jaxserve.tracing import INSTALL_HINT, otel_available

            if not self.otlp_traces_endpoint.strip():
                raise ValueError("otlp_traces_endpoint must be a URL (host:port), got an empty string")
            if not otel_available():
                raise ValueError(f"otlp_traces_endpoint needs OpenTelemetry: {INSTALL_HINT}")


# vLLM's allowed --max-lora-rank values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's LoRAConfig; jaxserve/lora). ``max_loras`` adapters can
    run in one step (device slots); ``max_lora_rank`` is every slot's rank (smaller
    adapters are zero padded); ``max_cpu_loras`` adapters are kept on the host (LRU;
    None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(LORA_RANKS)}, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer guesses up to
    ``num_speculative_tokens`` next tokens per request, the target model scores them all
    in one step, and exact verification (greedy identity, rejection sampling) keeps the
    accepted prefix plus one token of its own.

    method "ngram": the guesses continue the longest earlier match (between
    ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens) of the context's suffix.
    method "draft_model": a smaller ``model`` with the same tokenizer proposes them.
    ``disable_by_batch_size``: no speculation while more requests than this run (vLLM's
    ``disable_by_batch_size``). ``min_acceptance``: a request whose drafts were accepted
    less than this fraction of the time (over its last ``acceptance_window`` draft
    tokens) stops drafting. ``adaptive_drafts``: each step keeps only the drafts whose
    expected acceptance pays for their measured cost (see core/sched/spec_budget.py);
    seeded sampling requests keep theirs, so their output does not depend on timing."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance: float = 0.0
    acceptance_window: int = 32
    # Verify only the drafts that raise measured output per second (core/sched/spec_budget.py).
    adaptive_drafts: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [1, 16], got "
                             f"{self.num_speculative_tokens!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: both 5 when neither is set, else the one given for both.
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
                raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                                 f"{lo!r} and {hi!r}")
        elif not self.model:
            raise ValueError('speculative_config.model (the draft model folder) is required with method "draft_model"')
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"speculative_config.min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if self.acceptance_window < 1:
            raise ValueError(f"speculative_config.acceptance_window must be >= 1, got {self.acceptance_window}")

    @classmethod
    def from_dict(cls, value: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """From vLLM's dict (unknown keys are a ValueError naming them)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**value)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA off (--enable-lora turns it on)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # Padded sizes the runner compiles for; None: powers of two from the floor up to the max.
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    enforce_eager: bool = False  # skip the start-up warm-up
    # Serve once the smallest buckets are compiled; compile the rest on a thread.
    background_warmup: bool = False

    def __post_init__(self) -> None:
        # Checked here, not when a step first needs a missing bucket in the middle of serving.
        sc = self.scheduler_config
        if self.token_buckets and max(self.token_buckets) < sc.max_num_batched_tokens:
            raise ValueError(f"token_buckets: the largest ({max(self.token_buckets)}) must be at least "
                             f"max_num_batched_tokens ({sc.max_num_batched_tokens})")
        # The step gathers logits at max_num_seqs rows; a request bucket is a prefix of them.
        if self.request_buckets and max(self.request_buckets) != sc.max_num_seqs:
            raise ValueError(f"request_buckets: the largest ({max(self.request_buckets)}) must equal "
                             f"max_num_seqs ({sc.max_num_seqs})")
        # A step's drafts are proposed from the tokens of the step before, which async
        # scheduling does not wait for (vLLM refused the pair too, at first).
        if sc.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling does not work with speculative_config yet; use one or the other")
        if self.model_config.pooler_config is not None:
            # A pooling request ends with its prefill: nothing to sample, speculate or run ahead of.
            if self.speculative_config is not None:
                raise ValueError("speculative_config does not apply to a pooling model (runner='pooling')")
            if sc.async_scheduling:
                raise ValueError("async_scheduling does not apply to a pooling model (runner='pooling')")
            if self.lora_config is not None:
                raise ValueError("enable_lora does not work with a pooling model (runner='pooling') yet")
        if self.lora_config is not None:
            pc = self.parallel_config
            # The adapters' device slots are one set for the whole mesh, and the per-step
            # cap on distinct adapters is each scheduler's: with several ranks (or
            # processes replaying the leader's steps) the slots could be asked for more.
            if pc.data_parallel_size > 1:
                raise ValueError("enable_lora does not work with data_parallel_size > 1 yet")
            if (pc.num_processes or 1) > 1:
                raise ValueError("enable_lora does not work across processes (num_processes > 1) yet")
