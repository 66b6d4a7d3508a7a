"""LLMEngine: the synchronous engine (InputProcessor -> EngineCore -> OutputProcessor)."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.multimodal.processor import MultiModalProcessor, prompt_images
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.fault_injection import FaultInjector
from jaxserve.outputs import RequestFailedError, RequestOutput
from jaxserve.request import Request
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from jaxserve.core.sched.scheduler import Scheduler, SchedulerStats
    from jaxserve.engine.request_stream import RequestStream
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")

# A pooling request's sampling params: never sampled (the runner's rows still need some).
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def load_tokenizer(path: str):
    """The HF tokenizer of a model folder (transformers imported here, not at start-up)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        mc = config.model_config
        t0 = time.perf_counter()
        # The tokenizer (transformers' import and the load: most of a second) loads on a
        # thread while the engine core loads the weights and its programs, much of which
        # runs outside the GIL (file reads, device copies, XLA), so the two overlap.
        with ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, mc.tokenizer or mc.model)
            self.engine_core = EngineCore(config, mc.model, progress=progress)
            self.tokenizer = tokenizer.result()
        runner = self.model_runner
        eos = set(runner.arch.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else (
            min(eos) if eos else None)
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config, self.tokenizer, vocab_size=runner.vocab_size, eos_token_ids=eos)
        self.engine_core.attach_structured_output_manager(self.structured_output_manager)
        self.input_processor = InputProcessor(
            self.tokenizer, vocab_size=runner.vocab_size, max_model_len=config.scheduler_config.max_model_len,
            max_logprobs=mc.max_logprobs, eos_token_ids=eos,
            primary_eos=self.eos_token_id,
            kv_cache_blocks=runner.num_blocks - 1, block_size=runner.block_size,
            blocks_held=lambda n: runner.kv_cache_layout.blocks_held(
                n, runner.block_size, config.scheduler_config.max_num_batched_tokens),
            structured_output_manager=self.structured_output_manager,
            mm_processor=MultiModalProcessor.from_model(
                runner.model_path, runner.arch, self.tokenizer, limit_per_prompt=mc.limit_mm_per_prompt,
                max_image_tokens=min(config.scheduler_config.encoder_budget,
                                     config.scheduler_config.encoder_cache_rows)))
        pooler = mc.pooler_config
        self.output_processor = OutputProcessor(self.tokenizer, pooler.task if pooler is not None else None)
        endpoint = config.observability_config.otlp_traces_endpoint
        if endpoint is not None:
            from jaxserve.tracing import RequestTracer

            self.output_processor.tracer = RequestTracer(endpoint, model=mc.served_model_name or mc.model)
        # Tests and drills: JAXSERVE_FAULTS (engine/fault_injection.py); None normally.
        self.fault_injector = FaultInjector.from_env()
        self.startup_seconds = time.perf_counter() - t0
        # caller's request id -> engine request ids (children of n > 1), while unfinished.
        self._children: dict[str, list[str]] = {}

    # --------------------------------------------------------------- accessors
    @property
    def fault_injector(self) -> FaultInjector | None:
        return self.engine_core.fault_injector

    @fault_injector.setter
    def fault_injector(self, injector: FaultInjector | None) -> None:
        self.engine_core.fault_injector = injector
        self.output_processor.fault_injector = injector

    @property
    def model_runner(self) -> ModelRunner:
        return self.engine_core.model_runner

    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def num_steps(self) -> int:
        """Engine steps that ran the model so far."""
        return self.engine_core.num_steps

    @property
    def warmup_seconds(self) -> float:
        return self.engine_core.warmup_seconds

    @property
    def vocab_size(self) -> int:
        return self.model_runner.vocab_size

    @property
    def num_compiled_programs(self) -> int:
        return self.model_runner.num_compiled_programs

    def get_metrics(self) -> dict:
        """Counters since start for offline use: ``spec_decode`` (SpecDecodingStats.summary())
        when speculative decoding is on, ``num_steps``, ``num_preemptions``; for a
        vision-language model ``encoder``: images encoded, and image uses served without
        encoding (cached, or encoded once for several requests of a step)."""
        core = self.engine_core
        out = {"num_steps": core.num_steps, "num_preemptions": sum(s.num_preemptions for s in core.schedulers)}
        spec = core.spec_decoding_totals()
        if spec is not None:
            out["spec_decode"] = spec.summary()
        if self.model_runner.encoder is not None:
            caches = [s.encoder_cache for s in core.schedulers]
            out["encoder"] = {"num_encoded": sum(c.num_encoded for c in caches),
                              "num_reused": sum(c.num_reused for c in caches)}
        return out

    def make_stats(self) -> SchedulerStats:
        """The schedulers' stats snapshot (all data-parallel ranks together)."""
        return self.engine_core.make_stats()

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt, params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, add_special_tokens: bool = True,
                    stream: RequestStream | None = None, lora_request=None) -> None:
        text, ids = self.input_processor.tokenize(prompt, add_special_tokens=add_special_tokens)
        ids, mm = self.input_processor.process_images(prompt, ids)
        self.add_tokenized_request(request_id, text, ids, params, priority=priority, cache_salt=cache_salt,
                                   stream=stream, lora_request=lora_request, mm=mm)

    def add_tokenized_request(self, request_id: str, text, ids: list[int], params: SamplingParams, *,
                              priority: int = 0, cache_salt: str | None = None, stream: RequestStream | None = None,
                              arrival_time: float | None = None, lora_request=None,
                              trace_headers: dict[str, str] | None = None, mm=None) -> None:
        """``lora_request``: the LoRA adapter to run with (jaxserve.lora.LoRARequest; read
        and checked here on first use), None: the base model. ``trace_headers``: the
        caller's W3C trace context (traceparent / tracestate), the parent of the request's
        span when tracing is on. ``mm``: the prompt's images
        (InputProcessor.process_images), None: text only."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if self.config.model_config.pooler_config is not None:
            raise ValueError("this is a pooling model (runner='pooling'): it embeds / classifies / scores and does "
                             "not generate; use embed(), classify(), score() or encode()")
        self.input_processor.validate(ids, params)
        if lora_request is not None:
            from jaxserve.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            self.engine_core.add_lora(lora_request)
        resolved, max_tokens = self.input_processor.resolve_params(len(ids), params)
        children = [(request_id, 0, resolved)] if params.n == 1 else [
            (f"{i}_{request_id}", i,
             resolved.replace(n=1, seed=None if resolved.seed is None else resolved.seed + i))
            for i in range(params.n)
        ]
        # Checked before anything changes. Child ids ("0_x") share the engine's id space
        # with caller ids, so a caller's "0_x" must not clash with request "x"'s first child.
        states, core = self.output_processor.request_states, self.engine_core
        if request_id in self._children or any(c[0] in states or core.has_request(c[0]) for c in children):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._children[request_id] = [c[0] for c in children]
        for child_id, index, child_params in children:
            self.output_processor.add_request(child_id, request_id, index, text, ids, resolved, stream=stream,
                                              arrival_time=arrival_time, trace_headers=trace_headers)
            self.engine_core.add_request(Request(
                child_id, ids, child_params, None if params.ignore_eos else self.eos_token_id,
                priority=priority, cache_salt=cache_salt, max_tokens=max_tokens, arrival_time=arrival_time,
                lora_request=lora_request, mm=mm,
            ))

    def prepare_pooling(self, prompt, params: PoolingParams, *, add_special_tokens: bool = True,
                        tokenizer=None, input_processor: InputProcessor | None = None):
        """A pooling request's inputs, checked (docs/pooling.md): ``prompt`` as in
        add_request, or a (text_1, text_2) pair tokenized as one cross-encoder input ->
        (text, token ids after truncate_prompt_tokens, the resolved PoolingParams, the
        token type ids: the tokenizer's for a pair when the model embeds token types, else None).
        ValueError on a generative engine, or for params the model cannot serve.
        ``tokenizer`` / ``input_processor``: the caller's copies (AsyncLLM's, off the engine thread)."""
        tokenizer, input_processor = tokenizer or self.tokenizer, input_processor or self.input_processor
        pooler = self.config.model_config.pooler_config
        if pooler is None:
            raise ValueError("this model generates text (runner='generate'): pooling requests (embed, classify, "
                             "score) need a pooling model (runner='pooling')")
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        max_len = self.config.scheduler_config.max_model_len
        arch = self.model_runner.arch
        resolved = params.resolve(pooler, hidden_size=arch.hidden_size, max_model_len=max_len)
        types = None
        if isinstance(prompt, tuple):
            text = None
            enc = tokenizer(prompt[0], text_pair=prompt[1], add_special_tokens=add_special_tokens,
                            return_token_type_ids=True)
            ids = enc["input_ids"]
            # Only a BERT-style encoder reads them (models/bert.py); all zeros changes nothing.
            if arch.type_vocab_size > 1 and any(enc.get("token_type_ids") or ()):
                types = resolved.truncate(list(enc["token_type_ids"]), max_len)
        else:
            if prompt_images(prompt):
                raise ValueError("multi_modal_data: a pooling model takes text only")
            text, ids = input_processor.tokenize(prompt, add_special_tokens=add_special_tokens)
        ids = resolved.truncate(list(ids), max_len)
        input_processor.validate(ids, _POOLING_SAMPLING)
        return text, ids, resolved, types

    def add_pooling_request(self, request_id: str, prompt, params: PoolingParams, *, priority: int = 0,
                            add_special_tokens: bool = True) -> None:
        """A pooling request (prepare_pooling's inputs); its output is a PoolingRequestOutput."""
        text, ids, resolved, types = self.prepare_pooling(prompt, params, add_special_tokens=add_special_tokens)
        self.add_tokenized_pooling_request(request_id, text, ids, resolved, priority=priority, token_type_ids=types)

    def add_tokenized_pooling_request(self, request_id: str, text, ids: list[int], params: PoolingParams, *,
                                      priority: int = 0, stream: RequestStream | None = None,
                                      arrival_time: float | None = None,
                                      token_type_ids: list[int] | None = None,
                                      trace_headers: dict[str, str] | None = None) -> None:
        """A pooling request whose inputs prepare_pooling checked (``params`` resolved).
        token_type_ids ride to the model in the ids' high bits (models/bert.py); the
        output's prompt_token_ids are the plain ids."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        states, core = self.output_processor.request_states, self.engine_core
        if request_id in self._children or request_id in states or core.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._children[request_id] = [request_id]
        self.output_processor.add_request(request_id, request_id, 0, text, ids, _POOLING_SAMPLING, stream=stream,
                                          arrival_time=arrival_time, pooling_params=params,
                                          trace_headers=trace_headers)
        if token_type_ids is not None:
            from models.bert import pack_token_types

            ids = pack_token_types(ids, token_type_ids)
        # max_tokens 1 is never reached: the request ends with its prompt.
        self.engine_core.add_request(Request(request_id, ids, _POOLING_SAMPLING, None, priority=priority,
                                             max_tokens=1, arrival_time=arrival_time))

    def engine_request_ids(self, request_id: str) -> list[str]:
        """The engine-side ids of a caller's request (n > 1 has one child per completion)."""
        return [c for c in self._children.get(request_id, ()) if c in self.output_processor.request_states]

    def abort_request(self, request_ids: str | list[str]) -> list:
        """Abort requests (by the caller's id); returns the final abort outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        engine_ids = [eid for rid in request_ids for eid in self.engine_request_ids(rid)]
        for rid in request_ids:
            self._children.pop(rid, None)
        self.engine_core.abort_requests(engine_ids)
        return self.output_processor.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_work()

    # --------------------------------------------------------------- step
    def step_with_states(self):
        """One engine step: [(RequestState, RequestOutput | RequestFailedError)]. A failed
        request ends as a whole (its other choices, if n > 1, are aborted)."""
        core_outputs = self.engine_core.step()
        outputs, reqs_to_abort = self.output_processor.process_outputs(core_outputs)
        if reqs_to_abort:
            self.engine_core.finish_stopped(reqs_to_abort)
        for st, out in outputs:
            if isinstance(out, RequestFailedError):
                siblings = self.engine_request_ids(st.external_id)
                self.engine_core.abort_requests([st.request_id, *siblings])
                self.output_processor.drop_requests(siblings)
                self._children.pop(st.external_id, None)
            elif out.finished:
                self._children.pop(out.request_id, None)
        return outputs

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs; a request the engine failed raises its
        RequestFailedError (after the step, so the engine stays consistent)."""
        outputs = self.step_with_states()
        failed = next((out for _, out in outputs if isinstance(out, RequestFailedError)), None)
        if failed is not None:
            raise failed
        return [out for _, out in outputs]
