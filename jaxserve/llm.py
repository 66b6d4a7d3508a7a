"""LLM: the offline API, with vLLM's argument names."""
from __future__ import annotations

import logging
import os
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_resolver import resolve_model_path
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")


def enable_compilation_cache(path: str | None = None) -> None:
    """JAX's persistent compilation cache: a restart reuses compiled buckets."""
    import jax

    from models.default_model import cache_root

    path = path or os.environ.get("JAXSERVE_JAX_CACHE_DIR") or str(cache_root() / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build_engine_config(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    gpu_memory_utilization: float = 0.9,
    num_gpu_blocks_override: int | None = None,
    kv_cache_memory: int | None = None,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    max_logprobs: int = 20,
    attention_backend: str = "auto",
    scheduling_policy: str = "fcfs",
    served_model_name: str | None = None,
    generation_config: str = "auto",
    override_generation_config: dict | None = None,
    enforce_eager: bool = False,
    token_buckets: list[int] | None = None,
    request_buckets: list[int] | None = None,
    progress: bool = True,
    default_max_model_len: int = 8192,
) -> EngineConfig:
    """vLLM's engine arguments -> EngineConfig. Without max_model_len: the model's own
    limit, at most ``default_max_model_len``."""
    from models.config import ModelArchConfig

    path = resolve_model_path(model, progress=progress)
    arch = ModelArchConfig.from_pretrained(path)
    model_limit = arch.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(model_limit, default_max_model_len)
    elif max_model_len > model_limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {model_limit} positions")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if enable_chunked_prefill else max_model_len
    name = served_model_name or (model if model is not None else "SmolLM2-135M-Instruct")
    model_config = ModelConfig(model=path, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                               seed=seed, served_model_name=name, max_logprobs=max_logprobs,
                               attention_backend=attention_backend, generation_config=generation_config,
                               override_generation_config=override_generation_config)
    defaults = model_config.get_diff_sampling_param()
    if defaults:
        logger.info("Sampling defaults from the model's generation config: %s (a request's own values win; "
                    "generation_config='vllm' ignores them)", defaults)
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 num_gpu_blocks_override=num_gpu_blocks_override, kv_cache_memory=kv_cache_memory),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                         long_prefill_token_threshold=long_prefill_token_threshold,
                                         policy=scheduling_policy),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        enforce_eager=enforce_eager,
        token_buckets=tuple(token_buckets) if token_buckets else None,
        request_buckets=tuple(request_buckets) if request_buckets else None,
    )


class LLM:
    """Offline batched generation.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...          SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        use_cache = kwargs.pop("compilation_cache", True)
        if use_cache:
            enable_compilation_cache()
        progress = kwargs.get("progress", True)
        self.config = build_engine_config(model, **kwargs)
        self.llm_engine = LLMEngine(self.config, progress=progress)
        # Read once: generate() without sampling_params should not reread the file.
        self._default_sampling = self.config.model_config.get_diff_sampling_param()
        self.tokenizer = self.llm_engine.tokenizer
        self._counter = 0

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults applied
        (what ``generate`` / ``chat`` use when given no sampling_params)."""
        return SamplingParams(**self._default_sampling)

    def _params_list(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a str / {"prompt_token_ids": [...]} dict, or a list of them;
        sampling_params: one for all, a list (one per prompt), or None for
        ``get_default_sampling_params()``. Returns one RequestOutput per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(len(prompts), sampling_params)
        return self._run(
            [(p, sp, True) for p, sp in zip(prompts, params)], use_tqdm=use_tqdm, priority=priority)

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params_list(len(convs), sampling_params)
        items = []
        for conv, sp in zip(convs, params):
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template)
            # The template already holds the special tokens (BOS etc.).
            items.append((text, sp, False))
        return self._run(items, use_tqdm=use_tqdm)

    def _run(self, items, *, use_tqdm: bool, priority=None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, sp, add_special) in enumerate(items):
                rid = str(self._counter)
                self._counter += 1
                sp = sp.replace(output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(rid, prompt, sp, add_special_tokens=add_special,
                                   priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]
