"""LLM: the offline API, with vLLM's argument names."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import DEFAULT_MAX_MODEL_LEN
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core import pause_mode
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.multimodal.chat import split_content
from jaxserve.multimodal.processor import prompt_images
from jaxserve.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                              RequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.compilation_cache import enable_compilation_cache
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")


class LLM:
    """Offline batched generation.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...          SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, *, progress: bool = True, compilation_cache: bool = True,
                 default_max_model_len: int = DEFAULT_MAX_MODEL_LEN, **kwargs) -> None:
        """kwargs: EngineArgs fields (vLLM's names). ``progress``: progress bars for
        conversion, loading and warm-up; ``compilation_cache``: JAX's persistent cache;
        ``default_max_model_len``: the cap on the model's own limit when max_model_len is unset."""
        if compilation_cache:
            enable_compilation_cache()
        self.config = EngineArgs(model=model, **kwargs).create_engine_config(
            progress=progress, default_max_model_len=default_max_model_len)
        self.llm_engine = LLMEngine(self.config, progress=progress)
        # Read once: generate() without sampling_params should not reread the file.
        self._default_sampling = self.config.model_config.get_diff_sampling_param()
        self.tokenizer = self.llm_engine.tokenizer
        self._counter = 0
        # The research loop's calls (update_weights, sleep, pause, ...) may come from
        # another thread than generate(): each step and each call holds the lock, and
        # generate() waits on the condition while the engine holds new requests.
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self._generating = 0  # generate() / chat() calls stepping the engine now
        self._aborted: dict[str, RequestOutput] = {}  # pause_generation("abort")'s outputs, for their generate()

    def get_metrics(self) -> dict:
        """Engine counters since start: ``spec_decode`` = {num_drafts, num_draft_tokens,
        num_accepted_tokens, acceptance_rate, mean_acceptance_length,
        acceptance_rate_per_pos} with speculative decoding; num_steps; num_preemptions."""
        return self.llm_engine.get_metrics()

    def sequence_logprobs(self, token_ids) -> list:
        """Per-token logprobs of whole sequences, as a trainer computes them: for each
        sequence of T ids (a list of ints, or a list of such lists), a float32 array
        [T - 1] whose entry i is log p(token i + 1 | tokens 0..i), from the raw logits,
        in one forward with the engine's own model code and params (no scheduler, no
        paging). With ``batch_invariant=True`` these are bitwise the logprobs the engine
        returned while it sampled the same tokens (docs/batch_invariance.md)."""
        if len(token_ids) == 0:
            raise ValueError("token_ids: a sequence of ids, or a list of sequences; got none")
        seqs = [token_ids] if np.ndim(token_ids[0]) == 0 else list(token_ids)
        runner = self.llm_engine.model_runner
        return [runner.sequence_logprobs([int(t) for t in s]) for s in seqs]

    # ------------------------------------------------------------------ LoRA adapters (docs/lora.md)
    def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter (a jaxserve.lora.LoRARequest naming a PEFT folder) ahead of
        its first request; a bad adapter is a ValueError. True when it was read now."""
        return self.llm_engine.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter by its lora_int_id (requests running with it finish with it)."""
        return self.llm_engine.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters held in host memory."""
        return self.llm_engine.engine_core.list_loras()

    # ------------------------------------------------------------------ the research loop (docs/research_loop.md)
    def update_weights(self, weights) -> dict:
        """Serve new weights, with no recompile: ``weights`` is a folder (safetensors or
        orbax), a mapping of HF checkpoint names to arrays (numpy or jax.Array, any float
        dtype; all params or a subset, e.g. the layers that changed), or the engine's
        param pytree (``get_params()``'s structure: arrays of the same shape, dtype and
        sharding are taken with no copy). Requests running in another thread's generate()
        finish on the old weights first (new ones wait); the prefix cache is reset. A bad
        name, shape or dtype is a ValueError and the old weights keep serving. Returns
        {"version", "num_params", "seconds", "source"}."""
        return self._when_idle("update_weights", lambda core: core.update_weights(weights))

    def get_logprobs_fn(self):
        """A trainer's ``fn(params, token_ids) -> logprobs`` for this model: ``params`` of
        ``get_params()``'s structure, token_ids [T] int32, logprobs [T - 1] float32
        (entry i: log p(token i + 1 | tokens 0..i)); a jitted, differentiable JAX function
        (``jax.grad``, ``jax.vmap``) with the engine's own model code, its attention the
        reference one (runner/dense_forward.py). Use float32 params (``weight_dtype=
        "float32"``) to train on them."""
        from jaxserve.runner.dense_forward import make_sequence_logprobs

        return make_sequence_logprobs(self.llm_engine.model_runner, trainable=True)

    def get_params(self):
        """The served params, an ``nnx.State`` of the engine's own arrays (no copy): what
        a JAX trainer updates and hands back to ``update_weights``. Their dtypes are the
        served ones (on CPU, bfloat16 weights of the layer scan are stored as uint16 bit
        patterns; ``weight_dtype="float32"`` keeps them float32)."""
        return self.llm_engine.model_runner.get_params()

    @property
    def weights_version(self) -> int:
        """0 for the weights loaded at start; every update_weights adds 1."""
        return self.llm_engine.model_runner.weights_version

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 1; the weights stay on the devices) or the weights too
        (level 2), e.g. while a trainer runs. Requests made while asleep wait for
        ``wake_up()`` (from another thread). Returns the bytes freed {"weights", "kv_cache"}."""
        with self._lock:
            return self._when_idle("sleep", lambda core: core.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed (``tags``: "weights" and / or "kv_cache"; None:
        both). After level 2 the weights are re-read from the folder they last came from,
        unless update_weights gave them while asleep."""
        with self._lock:
            self.llm_engine.engine_core.wake_up(tags)
            self._released.notify_all()

    def is_sleeping(self) -> bool:
        return self.llm_engine.engine_core.is_sleeping

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (False while requests are running)."""
        with self._lock:
            return self.llm_engine.engine_core.reset_prefix_cache()

    def pause_generation(self, mode: str = "abort", *, wait_for_inflight_requests: bool | None = None,
                         clear_cache: bool = True) -> None:
        """Hold new requests until ``resume_generation()`` (vLLM's): "abort" (the default)
        ends every unfinished request now (finish_reason "abort"), "wait" lets the running
        ones finish; it returns once none runs. ``wait_for_inflight_requests`` (vLLM's
        older spelling) picks the mode when given. ``clear_cache``: reset the prefix
        cache then."""
        mode = pause_mode(mode, wait_for_inflight_requests)
        with self._lock:
            self.llm_engine.engine_core.hold("pause")
            try:
                if mode == "abort":
                    aborted = self.llm_engine.abort_request(list(self.llm_engine._children))
                    self._aborted.update({out.request_id: out for _, out in aborted})
                self._when_idle("pause_generation",
                                lambda core: core.reset_prefix_cache() if clear_cache else None)
            except BaseException:
                self.llm_engine.engine_core.release("pause")
                raise

    def resume_generation(self) -> None:
        with self._lock:
            self.llm_engine.engine_core.release("pause")
            self._released.notify_all()

    def is_paused(self) -> bool:
        return self.llm_engine.engine_core.is_paused

    def _when_idle(self, what: str, fn):
        """``fn(engine_core)`` once no request holds KV: with requests running (another
        thread's generate()), new ones are held until they finish."""
        core = self.llm_engine.engine_core
        with self._lock:
            if core.is_idle():
                return fn(core)
            if not self._generating:
                raise RuntimeError(f"{what}: {core.num_running()} request(s) are running and no generate() is "
                                   f"stepping them")
            hold = f"call:{what}"  # its own hold: fn may set and keep another ("sleep")
            core.hold(hold)
            try:
                while not core.is_idle():
                    self._released.wait(0.01)  # generate() steps them meanwhile (it takes the lock per step)
                return fn(core)
            finally:
                core.release(hold)
                self._released.notify_all()

    def _wait_while_held(self) -> None:
        """generate()'s requests wait while the engine is asleep or paused and nothing runs."""
        core = self.llm_engine.engine_core
        with self._lock:
            warned = False
            while core._holds and core.is_idle() and core.num_waiting():
                if not warned:
                    logger.warning("generate(): the engine is %s; the requests wait for %s",
                                   "asleep" if core.is_sleeping else "paused",
                                   "wake_up()" if core.is_sleeping else "resume_generation()")
                    warned = True
                self._released.wait(1.0)

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
                 priority: list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """prompts: a str / {"prompt_token_ids": [...]} dict, or a list of them;
        sampling_params: one for all, a list (one per prompt), or None for
        ``get_default_sampling_params()``; lora_request: a jaxserve.lora.LoRARequest for
        all prompts, a list (one per prompt, None: the base model), or None (needs
        ``enable_lora=True``). Returns one RequestOutput per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(len(prompts), sampling_params)
        return self._run(
            [(p, sp, True) for p, sp in zip(prompts, params)], use_tqdm=use_tqdm, priority=priority,
            loras=self._lora_list(len(prompts), lora_request))

    @staticmethod
    def _lora_list(n: int, lora_request) -> list:
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            return [lora_request] * n
        if len(lora_request) != n:
            raise ValueError(f"got {len(lora_request)} lora_request for {n} prompts")
        return list(lora_request)

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, lora_request=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them;
        a vision-language model's content may be a list of parts, text and
        ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or
        ``{"type": "image", "image": <PIL image / array>}``); lora_request as in generate()."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params_list(len(convs), sampling_params)
        items = []
        vlm = self.llm_engine.input_processor.mm_processor is not None
        for conv, sp in zip(convs, params):
            images = [] if vlm else None
            conv = [{**m, "content": split_content(m["content"], f"messages[{i}]", images)}
                    if isinstance(m.get("content"), list) else m for i, m in enumerate(conv)]
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template)
            # The template already holds the special tokens (BOS etc.). Image parts: the
            # prompt dict carries them (a data: URL, bytes, a PIL image or an array each).
            prompt = {"prompt": text, "multi_modal_data": {"image": [src for _, src in images]}} if images else text
            items.append((prompt, sp, False))
        return self._run(items, use_tqdm=use_tqdm, loras=self._lora_list(len(convs), lora_request))

    def beam_search(self, prompts, params, *, use_tqdm: bool = False, lora_request=None) -> list:
        """vLLM's beam search (jaxserve/beam_search.py): ``params`` a BeamSearchParams;
        prompts as in generate(). Returns one BeamSearchOutput per prompt: its best
        ``beam_width`` sequences, best first (``.tokens`` holds the prompt too, ``.text``
        their decoding, as vLLM's). Each step is one engine call over all live beams."""
        from jaxserve.beam_search import BeamSearch, top_logprobs

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if any(prompt_images(p) for p in prompts):
            raise ValueError("multi_modal_data: beam search does not take images yet")
        width = 2 * params.beam_width
        if width > self.config.model_config.max_logprobs:
            raise ValueError(f"beam_width={params.beam_width}: a step asks for 2 * beam_width = {width} logprobs, "
                             f"above max_logprobs={self.config.model_config.max_logprobs}")
        processor = self.llm_engine.input_processor
        ids = [processor.tokenize(p)[1] for p in prompts]
        search = BeamSearch(ids, params, processor.primary_eos)
        max_len = self.config.scheduler_config.max_model_len
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while not search.done:
            outs = self.generate([{"prompt_token_ids": t} for t in search.pending()], search.step_params(),
                                 use_tqdm=False, lora_request=lora_request)
            search.advance([top_logprobs(o) for o in outs], max_len=max_len)
            bar.update(1)
        bar.close()
        results = search.results()
        for result in results:
            for seq in result.sequences:
                seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return results

    # ------------------------------------------------------------------ pooling models (docs/pooling.md)
    def encode(self, prompts, pooling_params=None, *, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The raw pooled output of each prompt (``.outputs.data``: float32 [D] of an
        embedding model, unnormalized, or a classifier's logits [num_labels]).
        pooling_params: one PoolingParams for all, a list, or None (task "encode")."""
        return self._pool(prompts, pooling_params, "encode", use_tqdm, truncate_prompt_tokens)

    def embed(self, prompts, pooling_params=None, *, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``: a list of D floats,
        normalized unless the pooler config or PoolingParams(normalize=False) says not;
        PoolingParams(dimensions=k) keeps the first k of a Matryoshka model's)."""
        return [EmbeddingRequestOutput.from_base(o)
                for o in self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)]

    def classify(self, prompts, pooling_params=None, *, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt (``.outputs.probs``: softmax over num_labels, a
        sigmoid for one label) of a sequence classifier."""
        return [ClassificationRequestOutput.from_base(o)
                for o in self._pool(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)]

    def reward(self, prompts, *, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A reward model's scores per prompt (``.outputs.data``: the score head's raw
        outputs [num_labels] on the last token, no activation)."""
        if self.config.model_config.pooler_config is None or self.config.model_config.pooler_config.task != "classify":
            raise ValueError("reward() needs a sequence classifier (a *ForSequenceClassification reward model)")
        return self._pool(prompts, None, "encode", use_tqdm, truncate_prompt_tokens)

    def score(self, text_1, text_2, *, use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Relevance scores (``.outputs.score``) of pairs, vLLM's pairing: one text_1
        against each text_2 (1:N), or text_1[i] with text_2[i] (N:N). A cross-encoder
        (a one-label classifier) reads each pair as one input (the tokenizer's pair
        encoding) and scores it with a sigmoid; an embedding model scores the cosine of
        the two embeddings."""
        t1 = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        t2 = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if not t1 or not t2:
            raise ValueError("score: text_1 and text_2 need at least one text each")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        if len(t1) != len(t2):
            raise ValueError(f"score: text_1 has {len(t1)} texts and text_2 {len(t2)}: pass one text_1, or as many "
                             f"as text_2")
        pooler = self.config.model_config.pooler_config
        params = replace(pooling_params or PoolingParams(), task="score")
        if pooler is not None and pooler.task == "classify":
            if pooler.num_labels != 1:
                raise ValueError(f"score: a cross-encoder has one label; this classifier has {pooler.num_labels} "
                                 f"(use classify())")
            outs = self._pool(list(zip(t1, t2)), params, "score", use_tqdm, truncate_prompt_tokens)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outs]
        both = self._pool(t1 + t2, replace(params, normalize=True), "score", use_tqdm, truncate_prompt_tokens)
        n = len(t1)
        return [ScoringRequestOutput(a.request_id, ScoringOutput(float(np.dot(a.outputs.data, b.outputs.data))),
                                     a.prompt_token_ids + b.prompt_token_ids)
                for a, b in zip(both[:n], both[n:])]

    def _pool(self, prompts, pooling_params, task: str, use_tqdm: bool, truncate_prompt_tokens):
        if isinstance(prompts, (str, dict, tuple)):
            prompts = [prompts]
        params = pooling_params
        if params is None or isinstance(params, PoolingParams):
            params = [params or PoolingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        params = [replace(p, task=p.task or task) for p in params]  # a task a PoolingParams names stays
        if truncate_prompt_tokens is not None:
            params = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run([(p, None, True) for p in prompts], use_tqdm=use_tqdm, pooling=params)

    def _run(self, items, *, use_tqdm: bool, priority=None, loras=None, pooling=None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        with self._lock:  # pause_generation("abort") from another thread sees all of them or none
            try:
                for i, (prompt, sp, add_special) in enumerate(items):
                    rid = str(self._counter)
                    self._counter += 1
                    if pooling is not None:
                        engine.add_pooling_request(rid, prompt, pooling[i], add_special_tokens=add_special,
                                                   priority=priority[i] if priority else 0)
                        ids.append(rid)
                        continue
                    sp = sp.replace(output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(rid, prompt, sp, add_special_tokens=add_special,
                                       priority=priority[i] if priority else 0,
                                       lora_request=loras[i] if loras else None)
                    ids.append(rid)
            except Exception:
                engine.abort_request(ids)
                raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        self._generating += 1
        try:
            while engine.has_unfinished_requests():
                self._wait_while_held()
                with self._lock:
                    outputs = engine.step()
                    outputs += [self._aborted.pop(r) for r in ids if r in self._aborted]
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
            with self._lock:
                for out in [self._aborted.pop(r) for r in ids if r in self._aborted]:
                    results[out.request_id] = out
        except BaseException:
            # A failed request (RequestFailedError) or an interrupt: leave the engine empty
            # for the next call.
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            self._generating -= 1
            bar.close()
        return [results[r] for r in ids]
