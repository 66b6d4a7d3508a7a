"""POST /v1/chat/completions: the conversation goes through the tokenizer's chat
template (add_generation_prompt), then one engine request with n choices."""
from __future__ import annotations

import time
from typing import AsyncIterator

from server.errors import APIError, bad_request
from server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_uuid,
)
from server.serving_engine import OpenAIServing, clamp_logprob, collect_outputs, merge_async_iterators, sse_stream


class OpenAIServingChat(OpenAIServing):
    def _prepare(self, request: ChatCompletionRequest):
        if request.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice other than 'none' or 'auto' is not supported (no tool parser).",
                              "tool_choice")
        if request.top_logprobs is not None and request.top_logprobs > 0 and not request.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        text = self.render_chat(request)
        _, ids = self.tokenize_prompt(text, add_special_tokens=request.add_special_tokens)
        if not ids:
            raise bad_request("The rendered chat prompt is empty.", "messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        given = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if given is None:
            # Default: the rest of the context (vLLM); a prompt that alone fills it is a 400.
            self.check_length(len(ids), 0, param=param, prompt_param="messages")
            max_tokens = self.default_max_tokens(len(ids))
        else:
            max_tokens = given
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                      prompt_logprobs=request.prompt_logprobs)
        self.check_length(len(ids), max_tokens, param=param, prompt_param="messages")
        try:
            self.validate_inputs(ids, params, ChatCompletionRequest.model_fields)
        except APIError as e:
            if "logprobs" in e.message and e.param == "logprobs":
                e.param = "top_logprobs"
            raise
        return text, ids, params

    async def create_chat_completion(self, request: ChatCompletionRequest):
        """A ChatCompletionResponse, or (stream=True) an async iterator of SSE strings."""
        self.check_model(request.model)
        self.check_engine()
        self.check_stream_options(request)
        self.check_unsupported(request)
        _, ids, params = self._prepare(request)
        request_id = f"chatcmpl-{random_uuid()}"
        created = int(time.time())
        gen = self.engine_client.generate(ids, params, request_id, priority=request.priority,
                                          cache_salt=request.cache_salt)
        merged = merge_async_iterators(gen)
        if request.stream:
            chunks = self._stream(request, request_id, created, ids, merged)
            return sse_stream("chat", request_id, chunks, merged)
        return await self._full(request, request_id, created, ids, merged)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids: list[int], logprobs: list, k: int) -> ChatCompletionLogProbs:
        decode = self.tokenizer.decode
        content = []
        for tid, step in zip(token_ids, logprobs):
            lp = step.get(tid)
            token = lp.decoded_token if lp is not None and lp.decoded_token is not None else decode([tid])
            tops = sorted(((t, v) for t, v in step.items() if v.rank is not None and v.rank <= k),
                          key=lambda tv: tv[1].rank)[:k]
            top_list = []
            for t, v in tops:
                s = v.decoded_token if v.decoded_token is not None else decode([t])
                top_list.append(ChatCompletionLogProb(token=s, logprob=clamp_logprob(v.logprob),
                                                      bytes=list(s.encode("utf-8", errors="replace"))))
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top_list))
        return ChatCompletionLogProbs(content=content)

    # ------------------------------------------------------------------ responses
    async def _full(self, request, request_id, created, prompt_ids, merged) -> ChatCompletionResponse:
        n = request.n
        texts = [[] for _ in range(n)]
        token_ids = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        finish = [(None, None)] * n
        prompt_logprobs, cached = None, 0

        def on_output(_: int, out) -> None:
            nonlocal prompt_logprobs, cached
            for c in out.outputs:
                texts[c.index].append(c.text)
                token_ids[c.index].extend(c.token_ids)
                if c.logprobs is not None:
                    lps[c.index].extend(c.logprobs)
                if c.finish_reason is not None:
                    finish[c.index] = (c.finish_reason, c.stop_reason)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            cached = out.num_cached_tokens

        await collect_outputs(merged, on_output)
        k = request.top_logprobs or 0
        choices = [
            ChatCompletionResponseChoice(
                index=j, message=ChatMessage(role="assistant", content="".join(texts[j])),
                logprobs=self._logprobs(token_ids[j], lps[j], k) if request.logprobs else None,
                finish_reason=finish[j][0], stop_reason=finish[j][1])
            for j in range(n)
        ]
        generated = sum(len(t) for t in token_ids)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=generated,
                          total_tokens=len(prompt_ids) + generated, prompt_tokens_details=self.usage_details(cached))
        return ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name, choices=choices,
                                      usage=usage, prompt_logprobs=self.prompt_logprobs_json(prompt_logprobs))

    async def _stream(self, request, request_id, created, prompt_ids, merged) -> AsyncIterator[str]:
        """The response chunks as SSE events (sse_stream adds the error event and [DONE])."""
        n = request.n
        num_tokens = [0] * n
        role_sent = [False] * n
        cached = 0
        include_usage, continuous = self.stream_usage_options(request)
        num_prompt = len(prompt_ids)
        k = request.top_logprobs or 0
        model = self.served_model_name

        def chunk(choice, usage=None) -> str:
            c = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                             model=model, choices=[choice] if choice is not None else [])
            if usage is not None:
                c.usage = usage
            return self.sse(c)

        def running_usage(j):
            return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_tokens[j],
                             total_tokens=num_prompt + num_tokens[j]) if continuous else None

        async for _, out in merged:
            cached = out.num_cached_tokens
            for c in out.outputs:
                j = c.index
                if not role_sent[j]:
                    # Sent with the first engine output (after prefill), so TTFT is honest.
                    role_sent[j] = True
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=j, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                        finish_reason=None), running_usage(j))
                num_tokens[j] += len(c.token_ids)
                lp = None
                if request.logprobs and c.logprobs is not None:
                    lp = self._logprobs(c.token_ids, c.logprobs, k)
                choice = ChatCompletionResponseStreamChoice(index=j, delta=DeltaMessage(content=c.text),
                                                            logprobs=lp, finish_reason=c.finish_reason)
                if c.finish_reason is not None:
                    choice.stop_reason = c.stop_reason
                yield chunk(choice, running_usage(j))
        if include_usage:
            yield chunk(None, self.final_usage(num_prompt, sum(num_tokens), cached))
