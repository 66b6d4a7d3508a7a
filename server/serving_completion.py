"""POST /v1/completions: one engine request per prompt; n choices per prompt get
index prompt_idx * n + choice_idx (vLLM's numbering)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from server.errors import bad_request
from server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from server.serving_engine import (
    TRACE_HEADERS,
    OpenAIServing,
    clamp_logprob,
    collect_outputs,
    merge_async_iterators,
    sse_stream,
)
from server.structured import structured_outputs_from_request

_EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


@dataclass
class _PromptInput:
    text: str | None
    token_ids: list[int]
    params: object


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, prompt) -> list:
        """str | [str] | [int] | [[int]] -> a list of str / token-id lists."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request(_EMPTY_PROMPT, "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def _prepare(self, request: CompletionRequest) -> list[_PromptInput]:
        fields = CompletionRequest.model_fields
        constraint = structured_outputs_from_request(request)
        inputs = []
        for p in self._prompts(request.prompt):
            text, ids = self.tokenize_prompt(p, add_special_tokens=request.add_special_tokens)
            if not ids:
                raise bad_request(_EMPTY_PROMPT, "prompt")
            max_tokens = request.max_tokens if request.max_tokens is not None else self.default_max_tokens(len(ids))
            prompt_logprobs = request.prompt_logprobs
            if request.echo and request.logprobs is not None:
                prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
            # max_tokens=0 with echo (vLLM): return the prompt (and its logprobs) only; the
            # engine still runs one token, which is dropped (_echo_only).
            engine_max_tokens = max(max_tokens, 1) if request.max_tokens is None or self._echo_only(request) \
                else max_tokens
            params = self.sampling_params(request, max_tokens=engine_max_tokens, logprobs=request.logprobs,
                                          prompt_logprobs=prompt_logprobs, constraint=constraint)
            self.check_length(len(ids), max_tokens, param="max_tokens", prompt_param="prompt")
            self.validate_inputs(ids, params, fields, constraint)
            if text is None and request.echo:
                text = self.tokenizer.decode(ids)
            inputs.append(_PromptInput(text, ids, params))
        return inputs

    @staticmethod
    def _echo_only(request: CompletionRequest) -> bool:
        return bool(request.echo) and request.max_tokens == 0

    async def create_completion(self, request: CompletionRequest, raw_request=None):
        """A CompletionResponse, or (stream=True) an async iterator of SSE strings."""
        lora = self.check_model(request.model)
        self.check_engine()
        self.check_stream_options(request)
        if request.suffix is not None:
            raise bad_request("suffix is not currently supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of is not supported; use n.", "best_of")
        self.check_capacity(request.n or 1)  # before tokenizing: under overload a 503 should cost little
        if request.use_beam_search:
            return await self._beam_search(request, raw_request, lora)
        inputs = self._prepare(request)
        self.check_capacity(sum(inp.params.n for inp in inputs), "prompt" if len(inputs) > 1 else "n")
        request_id, engine_id = self.request_ids("cmpl", request, raw_request)
        created = int(time.time())
        generators = [
            self.engine_client.generate(inp.token_ids, inp.params, f"{engine_id}-{i}", priority=request.priority,
                                        cache_salt=request.cache_salt, lora_request=lora,
                                        trace_headers=TRACE_HEADERS.get())
            for i, inp in enumerate(inputs)
        ]
        merged = merge_async_iterators(*generators)
        if request.stream:
            chunks = self._stream(request, request_id, created, inputs, merged)
            return await sse_stream("completion", request_id, chunks, merged)
        return await self._full(request, request_id, created, inputs, merged)

    async def _beam_search(self, request: CompletionRequest, raw_request, lora) -> CompletionResponse:
        """use_beam_search: the n best beams of each prompt as its n choices."""
        if request.logprobs is not None:
            raise bad_request("logprobs are not returned with use_beam_search", "logprobs")
        inputs = self._prepare(request.model_copy(update={"n": 1}))  # tokenized and checked as one sequence
        request_id, engine_id = self.request_ids("cmpl", request, raw_request)
        choices, num_generated = [], 0
        for i, inp in enumerate(inputs):
            beams = await self.beam_search(inp.token_ids, request, inp.params.max_tokens, f"{engine_id}-{i}", lora)
            for j, seq in enumerate(beams):
                num_generated += len(seq.output_token_ids)
                text = ((inp.text or "") + seq.text) if request.echo else seq.text
                choices.append(CompletionResponseChoice(index=i * request.n + j, text=text,
                                                        finish_reason=seq.finish_reason))
        num_prompt = sum(len(inp.token_ids) for inp in inputs)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated)
        return CompletionResponse(id=request_id, created=int(time.time()), model=self.model_name(request),
                                  choices=choices, usage=usage)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids: list[int], top_logprobs, k: int, initial_text_offset: int) -> CompletionLogProbs:
        """OpenAI's completion logprobs. top_logprobs[i]: {token_id: Logprob} or None (the
        first prompt position). Each top_logprobs dict keeps the sampled token plus the
        top k (k or k + 1 entries)."""
        # Filled as plain lists and passed in at the end: fields left at their defaults
        # count as unset, and the stream serialises with exclude_unset.
        out = SimpleNamespace(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        decode = self.tokenizer.decode
        offset = initial_text_offset
        for i, tid in enumerate(token_ids):
            step = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else None
            lp = step.get(tid) if step else None
            if lp is None:
                token = decode([tid])
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                token = lp.decoded_token if lp.decoded_token is not None else decode([tid])
                out.token_logprobs.append(clamp_logprob(lp.logprob))
                # The top k plus the chosen token (k + 1 entries only when it is not among them).
                out.top_logprobs.append({
                    (v.decoded_token if v.decoded_token is not None else decode([t])): clamp_logprob(v.logprob)
                    for t, v in step.items() if t == tid or v.rank <= k})
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
        return CompletionLogProbs(**vars(out))

    # ------------------------------------------------------------------ responses
    async def _full(self, request, request_id, created, inputs, merged) -> CompletionResponse:
        n = request.n
        echo_only = self._echo_only(request)
        states = [[_ChoiceState() for _ in range(n)] for _ in inputs]
        prompt_logprobs = [None] * len(inputs)
        cached = [0] * len(inputs)

        def on_output(i: int, out) -> None:
            for c in out.outputs:
                s = states[i][c.index]
                if c.finish_reason is not None:
                    s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
                if echo_only:
                    continue
                s.text.append(c.text)
                s.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    s.logprobs = (s.logprobs or []) + list(c.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            cached[i] = out.num_cached_tokens

        await collect_outputs(merged, on_output)
        choices = []
        num_generated = 0
        for i, inp in enumerate(inputs):
            for j, s in enumerate(states[i]):
                text = "".join(s.text)
                num_generated += len(s.token_ids)
                lp = None
                if request.logprobs is not None:
                    ids, tops = s.token_ids, s.logprobs
                    if request.echo:
                        ids = inp.token_ids + ids
                        tops = list(prompt_logprobs[i] or [None] * len(inp.token_ids)) + list(tops or [])
                    lp = self._logprobs(ids, tops, request.logprobs, 0)
                if request.echo:
                    text = (inp.text or "") + text
                choices.append(CompletionResponseChoice(
                    index=i * n + j, text=text, logprobs=lp, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                    prompt_logprobs=self.prompt_logprobs_json(prompt_logprobs[i])))
        num_prompt = sum(len(inp.token_ids) for inp in inputs)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated, prompt_tokens_details=self.usage_details(sum(cached)))
        return CompletionResponse(id=request_id, created=created, model=self.model_name(request), choices=choices,
                                  usage=usage)

    async def _stream(self, request, request_id, created, inputs, merged) -> AsyncIterator[str]:
        """The response chunks as SSE events (sse_stream adds the error event and [DONE])."""
        n = request.n
        echo_only = self._echo_only(request)
        num_choices = n * len(inputs)
        num_tokens = [0] * num_choices
        text_offset = [0] * num_choices
        echoed = [False] * num_choices
        cached = [0] * len(inputs)
        include_usage, continuous = self.stream_usage_options(request)
        model = self.model_name(request)
        async for i, out in merged:
            inp = inputs[i]
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                idx = i * n + c.index
                text, ids, tops = ("", [], None) if echo_only else (c.text, c.token_ids, c.logprobs)
                if request.echo and not echoed[idx]:
                    echoed[idx] = True
                    text = (inp.text or "") + text
                    if request.logprobs is not None:
                        ids = inp.token_ids + list(ids)
                        tops = list(out.prompt_logprobs or [None] * len(inp.token_ids)) + list(tops or [])
                lp = None
                if request.logprobs is not None:
                    lp = self._logprobs(ids, tops, request.logprobs, text_offset[idx])
                text_offset[idx] += len(text)
                num_tokens[idx] += 0 if echo_only else len(c.token_ids)
                chunk = CompletionStreamResponse(
                    id=request_id, object="text_completion", created=created, model=model,
                    choices=[CompletionResponseStreamChoice(index=idx, text=text, logprobs=lp,
                                                            finish_reason=c.finish_reason,
                                                            stop_reason=c.stop_reason)])
                if continuous:
                    p = len(inp.token_ids)
                    chunk.usage = UsageInfo(prompt_tokens=p, completion_tokens=num_tokens[idx],
                                            total_tokens=p + num_tokens[idx])
                yield self.sse(chunk)
        if include_usage:
            usage = self.final_usage(sum(len(inp.token_ids) for inp in inputs), sum(num_tokens), sum(cached))
            yield self.sse(CompletionStreamResponse(id=request_id, object="text_completion", created=created,
                                                    model=model, choices=[], usage=usage))
