"""POST /v1/chat/completions: the conversation goes through the tokenizer's chat
template (add_generation_prompt), then one engine request with n choices.

The output of each choice goes through, in order: the reasoning parser
(--reasoning-parser: the thinking part becomes ``reasoning_content``), then, on the
content part only, the tool-call parsing that ``tool_choice`` asks for ("auto": the
--tool-call-parser; "required": a JSON array of calls; a named function: the whole
content is its arguments). Streamed or not, the same state machines run, so the
streamed deltas add up to the non-streamed message.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from jaxserve.reasoning.think_parser import ReasoningParser, StreamingReasoning
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
)
from server.serving_engine import (
    TRACE_HEADERS,
    OpenAIServing,
    clamp_logprob,
    collect_outputs,
    merge_async_iterators,
    sse_stream,
)
from server.structured import Constraint, chat_constraint, resolve_tool_choice
from server.tool_parsers import JsonArrayToolStreamer, NamedToolStreamer, ToolParser


@dataclass(frozen=True)
class ChatOutputMode:
    """How a request's output becomes a message: the tool choice ("none" | "auto" |
    "required" | "named"), the named function, whether more than one call is kept, and
    whether the reasoning is returned."""

    tool_choice: str = "none"
    function_name: str | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    # The prompt ended inside the reasoning (a template that opens <think> itself).
    reasoning_opened: bool = False
    # The request's tools (a parser may type the arguments by their schemas).
    tools: list[dict[str, Any]] | None = None


class ChatOutputShaper:
    """Reasoning split + tool-call parsing of one request's choices (stateless; the
    streaming state lives in ``ChoiceStream``)."""

    def __init__(self, mode: ChatOutputMode, *, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.mode = mode
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def _tool_streamer(self):
        choice = self.mode.tool_choice
        if choice == "auto":
            return self.tool_parser.streamer(self.mode.tools)
        if choice == "required":
            return JsonArrayToolStreamer()
        if choice == "named":
            return NamedToolStreamer(self.mode.function_name)
        return None

    def finish_reason(self, finish_reason: str | None, tools_called: bool) -> str | None:
        """"tool_calls" when an output that ended normally ("stop") made calls (auto /
        required; a named function keeps OpenAI's "stop"). A cut-off output stays "length"."""
        if tools_called and self.mode.tool_choice in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """A whole choice's text -> (message, finish_reason)."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text, opened=self.mode.reasoning_opened)
            if not self.mode.include_reasoning:
                reasoning = None
        tool_calls: list[dict[str, Any]] = []
        streamer = self._tool_streamer()
        if streamer is not None:
            extracted = streamer.extract(content or "")
            if extracted.tools_called:
                tool_calls, content = extracted.tool_calls, extracted.content
                if not self.mode.parallel_tool_calls:
                    tool_calls = tool_calls[:1]
        message = ChatMessage(role="assistant", content=content, tool_calls=tool_calls,
                              reasoning_content=reasoning, reasoning=reasoning)
        return message, self.finish_reason(finish_reason, bool(tool_calls))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's streaming state: text deltas -> DeltaMessages."""

    def __init__(self, shaper: ChatOutputShaper) -> None:
        self.shaper = shaper
        self.reasoning = (StreamingReasoning(shaper.reasoning_parser, opened=shaper.mode.reasoning_opened)
                          if shaper.reasoning_parser is not None else None)
        self.tools = shaper._tool_streamer()
        self.tools_called = False

    def feed(self, text: str, *, final: bool) -> DeltaMessage | None:
        """The delta for ``text`` (None when nothing can be sent yet). Without a reasoning
        parser and tool parsing, the text as it is (even empty)."""
        if self.reasoning is None and self.tools is None:
            return DeltaMessage(content=text)
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final=final)
            reasoning, content = (split.reasoning, split.content) if split is not None else (None, None)
            if not self.shaper.mode.include_reasoning:
                reasoning = None
        tool_calls = None
        if self.tools is not None:
            out = self.tools.feed(content or "", final=final)
            content = out.content or None
            tool_calls = [d for d in out.tool_calls if self.shaper.mode.parallel_tool_calls or d["index"] == 0]
            self.tools_called = self.tools_called or bool(tool_calls)
        fields: dict[str, Any] = {}
        if reasoning:
            fields.update(reasoning_content=reasoning, reasoning=reasoning)
        if content:
            fields["content"] = content
        if tool_calls:
            fields["tool_calls"] = tool_calls
        return DeltaMessage(**fields) if fields else None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.shaper.finish_reason(finish_reason, self.tools_called)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_parser: ToolParser | None = None, enable_auto_tools: bool = False,
                 reasoning_parser: ReasoningParser | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.enable_auto_tools = enable_auto_tools and tool_parser is not None
        self.reasoning_parser = reasoning_parser

    def _prepare(self, request: ChatCompletionRequest):
        """(text, ids, params, mode, mm): mm the images (MultiModalPrompt) of a
        vision-language model's request, else None. Image parts are fetched, decoded
        and preprocessed here: the caller runs it on a worker thread then."""
        tool_choice, function_name = resolve_tool_choice(request, auto_enabled=self.enable_auto_tools)
        constraint: Constraint | None = chat_constraint(request, tool_choice, function_name)
        if request.top_logprobs is not None and request.top_logprobs > 0 and not request.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        images = [] if self.mm_processor is not None else None
        text = self.render_chat(request, images)
        _, ids = self.tokenize_prompt(text, add_special_tokens=request.add_special_tokens)
        if not ids:
            raise bad_request("The rendered chat prompt is empty.", "messages")
        mm = None
        if images:
            ids, mm = self.expand_images(ids, self.load_images(images))
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        given = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if given is None:
            # Default: the rest of the context (vLLM); a prompt that alone fills it is a 400.
            self.check_length(len(ids), 0, param=param, prompt_param="messages")
            max_tokens = self.default_max_tokens(len(ids))
        else:
            max_tokens = given
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        skip_special = None
        if tool_choice == "auto":
            skip_special = self.tool_parser.skip_special_tokens(request.skip_special_tokens)
        if self.reasoning_parser is not None and self.reasoning_parser.keeps_special_tokens:
            skip_special = False
        params = self.sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                      prompt_logprobs=request.prompt_logprobs, constraint=constraint,
                                      skip_special_tokens=skip_special)
        self.check_length(len(ids), max_tokens, param=param, prompt_param="messages")
        try:
            self.validate_inputs(ids, params, ChatCompletionRequest.model_fields, constraint)
        except APIError as e:
            if "logprobs" in e.message and e.param == "logprobs":
                e.param = "top_logprobs"
            raise
        mode = ChatOutputMode(tool_choice=tool_choice, function_name=function_name,
                              parallel_tool_calls=request.parallel_tool_calls is not False,
                              include_reasoning=request.include_reasoning, tools=request.tools,
                              reasoning_opened=(self.reasoning_parser is not None
                                                and self.reasoning_parser.prompt_opens_reasoning(ids)))
        return text, ids, params, mode, mm

    async def _prepare_async(self, request: ChatCompletionRequest):
        """_prepare, on a worker thread for a vision-language model (images are fetched
        and preprocessed there, never in the event loop)."""
        if self.mm_processor is None:
            return self._prepare(request)
        return await asyncio.to_thread(self._prepare, request)

    def output_shaper(self, mode: ChatOutputMode) -> ChatOutputShaper:
        return ChatOutputShaper(mode, tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request=None):
        """A ChatCompletionResponse, or (stream=True) an async iterator of SSE strings."""
        lora = self.check_model(request.model)
        self.check_engine()
        self.check_stream_options(request)
        # Before the chat template and tokenizing: under overload a 503 should cost little.
        self.check_capacity(request.n or 1)
        if request.use_beam_search:
            return await self._beam_search(request, raw_request, lora)
        _, ids, params, mode, mm = await self._prepare_async(request)
        self.check_capacity(params.n)
        shaper = self.output_shaper(mode)
        request_id, engine_id = self.request_ids("chatcmpl", request, raw_request)
        created = int(time.time())
        gen = self.engine_client.generate(ids, params, engine_id, priority=request.priority,
                                          cache_salt=request.cache_salt, lora_request=lora,
                                          trace_headers=TRACE_HEADERS.get(), **({"mm": mm} if mm else {}))
        merged = merge_async_iterators(gen)
        if request.stream:
            chunks = self._stream(request, request_id, created, ids, merged, shaper)
            return await sse_stream("chat", request_id, chunks, merged)
        return await self._full(request, request_id, created, ids, merged, shaper)

    async def _beam_search(self, request: ChatCompletionRequest, raw_request, lora) -> ChatCompletionResponse:
        """use_beam_search: the n best beams as the n choices (plain text: no tool parsing)."""
        if request.logprobs:
            raise bad_request("logprobs are not returned with use_beam_search", "logprobs")
        _, ids, params, _, mm = await self._prepare_async(request.model_copy(update={"n": 1}))
        if mm is not None:
            raise bad_request("use_beam_search does not take images yet.", "use_beam_search")
        request_id, engine_id = self.request_ids("chatcmpl", request, raw_request)
        beams = await self.beam_search(ids, request, params.max_tokens, engine_id, lora)
        choices = [ChatCompletionResponseChoice(index=j, message=ChatMessage(role="assistant", content=seq.text),
                                                finish_reason=seq.finish_reason) for j, seq in enumerate(beams)]
        generated = sum(len(seq.output_token_ids) for seq in beams)
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=generated, total_tokens=len(ids) + generated)
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=self.model_name(request),
                                      choices=choices, usage=usage)

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
    async def _full(self, request, request_id, created, prompt_ids, merged, shaper) -> ChatCompletionResponse:
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
        choices = []
        for j in range(n):
            message, finish_reason = shaper.message("".join(texts[j]), finish[j][0])
            choices.append(ChatCompletionResponseChoice(
                index=j, message=message, logprobs=self._logprobs(token_ids[j], lps[j], k) if request.logprobs else None,
                finish_reason=finish_reason, stop_reason=finish[j][1]))
        generated = sum(len(t) for t in token_ids)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=generated,
                          total_tokens=len(prompt_ids) + generated, prompt_tokens_details=self.usage_details(cached))
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name(request), choices=choices,
                                      usage=usage, prompt_logprobs=self.prompt_logprobs_json(prompt_logprobs))

    async def _stream(self, request, request_id, created, prompt_ids, merged, shaper) -> AsyncIterator[str]:
        """The response chunks as SSE events (sse_stream adds the error event and [DONE])."""
        n = request.n
        num_tokens = [0] * n
        role_sent = [False] * n
        states = [shaper.stream() for _ in range(n)]
        cached = 0
        include_usage, continuous = self.stream_usage_options(request)
        num_prompt = len(prompt_ids)
        k = request.top_logprobs or 0
        model = self.model_name(request)

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
                final = c.finish_reason is not None
                delta = states[j].feed(c.text, final=final)
                if delta is None:
                    if not final and lp is None:
                        continue  # held back (a tag or call still forming): nothing to send yet
                    delta = DeltaMessage()
                choice = ChatCompletionResponseStreamChoice(index=j, delta=delta, logprobs=lp,
                                                            finish_reason=states[j].finish_reason(c.finish_reason))
                if final:
                    choice.stop_reason = c.stop_reason
                yield chunk(choice, running_usage(j))
        if include_usage:
            yield chunk(None, self.final_usage(num_prompt, sum(num_tokens), cached))


async def chat_stream_chunks(sse: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The chunks of a chat SSE stream (create_chat_completion's) as dicts, for the APIs
    translated onto chat (server/serving_messages.py, serving_responses.py); an error
    event is yielded as its {"error": ...} dict; the iterator is closed at the end."""
    try:
        async for raw in sse:
            payload = raw.removeprefix("data: ").strip()
            if payload and payload != "[DONE]":
                yield json.loads(payload)
    finally:
        await sse.aclose()
