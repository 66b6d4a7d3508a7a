"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``),
translated onto chat completions as vLLM and SGLang serve it: the request becomes a
ChatCompletionRequest (system, text / tool_use / tool_result / thinking blocks, tools
with input_schema, tool_choice, stop_sequences, output_config.format as a JSON schema;
temperature / top_p / top_k, which the 2026 SDK only sends in extra_body), the answer and the stream go back
in Anthropic's shapes (content blocks, stop_reason, its typed stream events), and
errors are Anthropic's envelope ({"type": "error", "error": {"type", "message"}}).

Images, documents and the server tools Anthropic runs itself (web search, code
execution, bash, ...) are a 400 naming the block or tool: this server runs text models
and executes no tools.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi.responses import JSONResponse
from pydantic import Field

from server.errors import APIError, bad_request, parse_body as parse
from server.limits import MAX_MESSAGES, MAX_TOOLS
from server.protocol import ChatCompletionRequest, RequestModel, random_uuid
from server.serving_chat import chat_stream_chunks

# Anthropic's error types by HTTP status (its SDK maps the status, the envelope names it).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestModel):
    model: str | None = None
    max_tokens: int = Field(..., ge=1)
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: Annotated[list[dict[str, Any]] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": {...}}}: structured output; "effort" is ignored.
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestModel):
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def anthropic_error(e: APIError) -> JSONResponse:
    """An APIError in Anthropic's envelope, with its status."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _text_of(content, where: str) -> str:
    """A string, or the text of a list of text blocks (a system prompt, a tool result)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        if block.get("type") != "text":
            raise bad_request(f"{where}: only text blocks are supported here, got {block.get('type')!r}", where)
        parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def _chat_messages(req) -> list[dict]:
    """Anthropic's turns as chat messages: tool_result blocks become tool messages (before
    the turn's text, as they answer the previous assistant turn), tool_use blocks the
    assistant's tool_calls, thinking blocks its reasoning_content."""
    out = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, thinking = [], [], []
        for block in blocks:
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_result" and m.role == "user":
                result = _text_of(block.get("content"), f"messages.{i}.content")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": ("Error: " + result) if block.get("is_error") else result})
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": str(block.get("id") or f"toolu_{random_uuid()}"), "type": "function",
                              "function": {"name": str(block.get("name", "")),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                thinking.append(str(block.get("thinking", "")))
            else:
                raise bad_request(f"messages.{i}.content: a {kind!r} block in a {m.role} turn is not supported "
                                  f"(text, tool_use, tool_result and thinking blocks are)", "messages")
        if m.role == "user":
            if texts or not blocks:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            msg: dict = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def _chat_tools(req) -> dict:
    """tools / tool_choice as chat's (function tools from input_schema)."""
    fields: dict = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") not in (None, "custom"):
                raise bad_request(f"tools.{i}: {t.get('type')!r} is a tool Anthropic's servers run; this server "
                                  f"runs none (declare a custom tool with input_schema instead)", "tools")
            if not t.get("name"):
                raise bad_request(f"tools.{i}: a tool needs a name", "tools")
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    elif req.tools:
        fields["tool_choice"] = "auto"
    return fields


def _thinking(req) -> dict:
    """thinking {"type": "disabled"}: the chat template's enable_thinking off (Qwen3-style templates)."""
    if req.thinking and req.thinking.get("type") == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {}


def _output_format(req) -> dict:
    """output_config.format (a JSON schema the text must follow) as chat's response_format."""
    fmt = (req.output_config or {}).get("format")
    if not fmt:
        return {}
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    body = {"model": req.model, "messages": _chat_messages(req), "max_tokens": req.max_tokens,
            "stop": req.stop_sequences, "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, **_chat_tools(req), **_thinking(req), **_output_format(req)}
    if req.stream:  # every chunk carries the usage: message_start needs input_tokens
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:  # a model's malformed arguments are passed on, not dropped
        return {"_raw_arguments": arguments}


def _stop(finish_reason: str | None, stop_reason, stop_sequences, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms; ``called``: the answer holds a
    tool_use block (tool_use then, whatever chat's reason: a forced call ends with "stop")."""
    if finish_reason is None:
        return None, None
    if called and finish_reason != "length":
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


class OpenAIServingMessages:
    """The Messages routes over the chat serving (server/serving_chat.py)."""

    def __init__(self, serving_chat) -> None:
        self.chat = serving_chat

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat = parse(ChatCompletionRequest, {
            "model": req.model, "messages": _chat_messages(req), **_chat_tools(req), **_thinking(req)})
        self.chat.check_model(chat.model)
        _, ids = self.chat.tokenize_prompt(self.chat.render_chat(chat), add_special_tokens=chat.add_special_tokens)
        return {"input_tokens": len(ids)}

    async def create_message(self, req: MessagesRequest, raw_request=None):
        """A message (dict), or with stream=True an async iterator of its SSE events."""
        result = await self.chat.create_chat_completion(to_chat_request(req), raw_request)
        message_id = f"msg_{random_uuid()}"
        if req.stream:
            return self._events(result, message_id, req)
        choice = result.choices[0]
        msg = choice.message
        content: list[dict] = []
        reasoning = msg.reasoning_content or msg.reasoning
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if msg.content:
            content.append({"type": "text", "text": msg.content})
        for call in msg.tool_calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _tool_input(call["function"].get("arguments"))})
        stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, req.stop_sequences,
                                           bool(msg.tool_calls))
        usage = {"input_tokens": result.usage.prompt_tokens, "output_tokens": result.usage.completion_tokens or 0}
        details = result.usage.prompt_tokens_details
        if details is not None and details.cached_tokens:
            usage["cache_read_input_tokens"] = details.cached_tokens
        return {"id": message_id, "type": "message", "role": "assistant", "model": result.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    async def _events(self, chunks: AsyncIterator[str], message_id: str, req: MessagesRequest) -> AsyncIterator[str]:
        """Chat's SSE chunks -> Anthropic's events: message_start, then per content block
        content_block_start / _delta (text_delta, thinking_delta, input_json_delta) /
        _stop, then message_delta (stop_reason, output_tokens) and message_stop."""
        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        index, block = -1, None  # the open content block's index and kind ("text", "thinking", "tool_use")
        started, finish, stop_reason, output_tokens, called = False, None, None, 0, False

        def open_block(kind: str, start: dict):
            nonlocal index, block
            out = [event("content_block_stop", {"index": index})] if block is not None else []
            index, block = index + 1, kind
            return out + [event("content_block_start", {"index": index, "content_block": start})]

        stream = chat_stream_chunks(chunks)
        try:
            async for chunk in stream:
                if "error" in chunk:  # chat's error event, after the status went out
                    err = chunk["error"]
                    yield event("error", {"error": {"type": _ERROR_TYPES.get(err.get("code"), "api_error"),
                                                    "message": err.get("message", "")}})
                    return
                usage = chunk.get("usage") or {}
                output_tokens = usage.get("completion_tokens") or output_tokens
                if not started:
                    started = True
                    yield event("message_start", {"message": {
                        "id": message_id, "type": "message", "role": "assistant", "model": chunk.get("model"),
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        if block != "thinking":
                            for e in open_block("thinking", {"type": "thinking", "thinking": ""}):
                                yield e
                        yield event("content_block_delta", {"index": index,
                                                            "delta": {"type": "thinking_delta", "thinking": thought}})
                    if delta.get("content"):
                        if block != "text":
                            for e in open_block("text", {"type": "text", "text": ""}):
                                yield e
                        yield event("content_block_delta", {"index": index,
                                                            "delta": {"type": "text_delta", "text": delta["content"]}})
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):  # a new call
                            called = True
                            for e in open_block("tool_use", {"type": "tool_use", "id": call["id"],
                                                             "name": fn.get("name", ""), "input": {}}):
                                yield e
                        if fn.get("arguments") and block == "tool_use":
                            yield event("content_block_delta", {"index": index, "delta": {
                                "type": "input_json_delta", "partial_json": fn["arguments"]}})
                    if choice.get("finish_reason") is not None:
                        finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
            if block is not None:
                yield event("content_block_stop", {"index": index})
            reason, sequence = _stop(finish, stop_reason, req.stop_sequences, called)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": output_tokens}})
            yield event("message_stop", {})
        finally:
            await stream.aclose()
