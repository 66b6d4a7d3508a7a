"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``), vLLM's subset, translated onto chat completions:

- ``input``: a string, or a list of items: messages (``input_text`` / ``output_text``
  parts), ``function_call`` and ``function_call_output`` items (a tool round trip),
  ``reasoning`` items (dropped: the template gets the answer, as on chat);
  ``instructions`` is the system message;
- ``tools`` (function tools) and ``tool_choice``; the hosted tools OpenAI runs (web
  search, file search, code interpreter, computer use, image generation, MCP, shell) are
  a 400: this server executes no tools;
- ``text.format`` (json_schema / json_object) as a structured output, ``reasoning``
  items from the reasoning parser, ``max_output_tokens``, ``temperature``, ``top_p``;
- ``stream``: the typed events (response.created, response.in_progress,
  response.output_item.added, response.content_part.added, response.output_text.delta,
  response.reasoning_text.delta, response.function_call_arguments.delta, their .done
  events, response.completed / response.incomplete);
- ``store`` (default true) keeps the response, and the conversation that produced it,
  in memory, the oldest dropped past a bound (ResponseStore): ``previous_response_id``
  continues a conversation, GET returns a response, ``background`` runs one as a task
  that GET polls and cancel stops.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Annotated, Any, AsyncIterator

from pydantic import Field

from server.errors import APIError, bad_request, parse_body
from server.limits import MAX_MESSAGES, MAX_TOOLS
from server.protocol import ChatCompletionRequest, RequestModel, random_uuid
from server.serving_chat import chat_stream_chunks

HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "computer", "image_generation", "mcp", "local_shell", "shell")
DEFAULT_STORE_SIZE = 1000


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


class ResponseStore:
    """Responses kept in memory (``store``): id -> (response, the chat messages that led to
    it plus its answer, the task of a background one). The oldest go past ``max_size``."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE) -> None:
        self.max_size = max_size
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def put(self, response: dict, messages: list[dict] | None = None, task=None) -> None:
        entry = self._items.pop(response["id"], {})
        entry.update(response=response, **({"messages": messages} if messages is not None else {}),
                     **({"task": task} if task is not None else {}))
        self._items[response["id"]] = entry
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict:
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return entry


def _text_parts(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(str(part.get("text", "")))
        elif kind == "refusal":
            parts.append(str(part.get("refusal", "")))
        else:
            raise bad_request(f"{where}: a {kind!r} part is not supported (this server runs text models; "
                              f"input_text and output_text are)", "input")
    return "".join(parts)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages (function calls merged into one
    assistant turn, their outputs as tool messages)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role", "user")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input.{i}.role must be user, assistant, system or developer, got {role!r}",
                                  "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_parts(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{random_uuid()}"), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input.{i}: an item of type {kind!r} is not supported", "input")
    return out


def _chat_tools(req: ResponsesRequest) -> dict:
    fields: dict = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type")
            if kind in HOSTED_TOOLS or (kind or "").startswith(("web_search", "computer")):
                raise bad_request(f"tools.{i}: {kind!r} is a tool OpenAI's servers run; this server runs none "
                                  f"(declare a function tool instead)", "tools")
            if kind != "function" or not t.get("name"):
                raise bad_request(f"tools.{i}: only function tools with a name are supported, got {kind!r}", "tools")
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                              "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    elif req.tools:
        fields["tool_choice"] = "auto"
    if req.parallel_tool_calls is False:
        fields["parallel_tool_calls"] = False
    return fields


def _response_format(req: ResponsesRequest) -> dict:
    fmt = (req.text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt.get("schema") or {}, "strict": fmt.get("strict")}}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}", "text")


def _usage(usage: dict, reasoning_tokens: int = 0) -> dict:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


class OpenAIServingResponses:
    """The Responses routes over the chat serving (server/serving_chat.py)."""

    def __init__(self, serving_chat, store_size: int = DEFAULT_STORE_SIZE) -> None:
        self.chat = serving_chat
        self.store = ResponseStore(store_size)

    # ------------------------------------------------------------------ requests
    def _conversation(self, req: ResponsesRequest) -> list[dict]:
        """The chat messages of this turn: the previous response's conversation (its own
        instructions are not carried over, as OpenAI's), this turn's instructions and input."""
        history = []
        if req.previous_response_id:
            entry = self.store.get(req.previous_response_id)
            if "messages" not in entry:
                raise bad_request(f"previous_response_id {req.previous_response_id!r} has not finished",
                                  "previous_response_id")
            history = [m for m in entry["messages"] if m["role"] != "system"]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        return system + history + input_messages(req)

    def _chat_request(self, req: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
        body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "stream": stream,
                "temperature": req.temperature, "top_p": req.top_p, **_chat_tools(req), **_response_format(req)}
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return parse_body(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})

    def _base(self, req: ResponsesRequest, response_id: str, created: float, model: str) -> dict:
        """The fields of a response object that do not depend on the output."""
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return {"id": response_id, "object": "response", "created_at": created, "model": model,
                "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id":
                req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": tool_choice, "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
                "reasoning": req.reasoning, "store": req.store, "background": req.background,
                "metadata": req.metadata or {}, "usage": None}

    async def create_response(self, req: ResponsesRequest, raw_request=None):
        """A response (dict), or with stream=True an async iterator of its SSE events."""
        if req.stream and req.background:
            raise bad_request("background responses cannot be streamed here; poll GET /v1/responses/{id}", "stream")
        if req.background and not req.store:
            raise bad_request("background requires store=true (the result is fetched from the store)", "background")
        messages = self._conversation(req)
        response_id, created = f"resp_{random_uuid()}", time.time()
        chat = self._chat_request(req, messages, req.stream)
        self.chat.check_model(chat.model)
        model = req.model or self.chat.model_name(chat)
        base = self._base(req, response_id, created, model)
        if req.background:
            task = asyncio.create_task(self._finish(req, chat, messages, base, None))
            queued = base | {"status": "queued"}
            self.store.put(queued, task=task)
            return queued
        if req.stream:
            return await self._events(req, chat, messages, base, raw_request)
        return await self._finish(req, chat, messages, base, raw_request)

    async def _finish(self, req, chat, messages, base, raw_request) -> dict:
        """Run a non-streamed response to its end (stored when ``store``)."""
        if req.background:
            self.store.put(base | {"status": "in_progress"})
        try:
            result = await self.chat.create_chat_completion(chat, raw_request)
        except asyncio.CancelledError:
            if req.background:
                self.store.put(base | {"status": "cancelled"})
            raise
        except APIError as e:
            if not req.background:
                raise
            failed = base | {"status": "failed", "error": {"code": str(e.status), "message": e.message}}
            self.store.put(failed)
            return failed
        choice = result.choices[0]
        output = self._output_items(choice.message)
        response = self._done(base, output, choice.finish_reason, result.usage.model_dump(),
                              reasoning_tokens=0)
        if req.store:
            self.store.put(response, messages + self._answer_messages(output))
        return response

    @staticmethod
    def _output_items(msg) -> list[dict]:
        items = []
        reasoning = msg.reasoning_content or msg.reasoning
        if reasoning:
            items.append({"type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})
        if msg.content:
            items.append({"type": "message", "id": f"msg_{random_uuid()}", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": msg.content, "annotations": [],
                                       "logprobs": []}]})
        for call in msg.tool_calls:
            items.append({"type": "function_call", "id": f"fc_{random_uuid()}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"].get("arguments", ""),
                          "status": "completed"})
        return items

    @staticmethod
    def _answer_messages(output: list[dict]) -> list[dict]:
        """A response's output as the chat turn a follow-up continues from."""
        text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in output if item["type"] == "function_call"]
        msg: dict = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]

    @staticmethod
    def _done(base: dict, output: list[dict], finish_reason: str | None, usage: dict, reasoning_tokens: int) -> dict:
        incomplete = finish_reason == "length"
        return base | {"status": "incomplete" if incomplete else "completed", "output": output,
                       "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                       "usage": _usage(usage, reasoning_tokens), "completed_at": None if incomplete else time.time()}

    # ------------------------------------------------------------------ GET / cancel
    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id)["response"]

    async def cancel(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        task = entry.get("task")
        if task is None or entry["response"]["status"] not in ("queued", "in_progress"):
            raise bad_request(f"Response {response_id} is {entry['response']['status']}: only a background "
                              f"response still running can be cancelled", "response_id")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return self.store.get(response_id)["response"]

    # ------------------------------------------------------------------ streaming
    async def _events(self, req, chat, messages, base, raw_request) -> AsyncIterator[str]:
        """Chat's SSE chunks -> the Responses stream's typed events."""
        sse = await self.chat.create_chat_completion(chat, raw_request)
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        return self._stream_events(req, messages, base, chat_stream_chunks(sse), event)

    async def _stream_events(self, req, messages, base, chunks, event) -> AsyncIterator[str]:
        output: list[dict] = []  # the items so far; the last one may be open
        open_kind = None  # "reasoning", "message" or "function_call"
        finish, usage, reasoning_tokens = None, {}, 0

        def close():
            """The events that end the open item."""
            nonlocal open_kind
            if open_kind is None:
                return []
            item, i = output[-1], len(output) - 1
            item["status"] = "completed"
            if open_kind == "reasoning":
                text = item["content"][0]["text"]
                out = [event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text)]
            elif open_kind == "message":
                part = item["content"][0]
                out = [event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=part["text"], logprobs=[]),
                       event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part)]
            else:
                out = [event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=item["arguments"], name=item["name"])]
            open_kind = None
            return out + [event("response.output_item.done", output_index=i, item=item)]

        def open_item(kind: str, item: dict):
            nonlocal open_kind
            out = close()
            output.append(item)
            open_kind = kind
            out.append(event("response.output_item.added", output_index=len(output) - 1,
                             item=item | ({"content": []} if kind == "message" else {})))
            if kind == "message":
                out.append(event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            return out

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        try:
            async for chunk in chunks:
                if "error" in chunk:
                    err = chunk["error"]
                    yield event("error", code=str(err.get("code")), message=err.get("message", ""), param=None)
                    failed = base | {"status": "failed", "error": {"code": str(err.get("code")),
                                                                   "message": err.get("message", "")}}
                    yield event("response.failed", response=failed)
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        if open_kind != "reasoning":
                            for e in open_item("reasoning", {
                                    "type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}):
                                yield e
                        output[-1]["content"][0]["text"] += thought
                        yield event("response.reasoning_text.delta", item_id=output[-1]["id"],
                                    output_index=len(output) - 1, content_index=0, delta=thought)
                    if delta.get("content"):
                        if open_kind != "message":
                            for e in open_item("message", {
                                    "type": "message", "id": f"msg_{random_uuid()}", "role": "assistant",
                                    "status": "in_progress",
                                    "content": [{"type": "output_text", "text": "", "annotations": [],
                                                 "logprobs": []}]}):
                                yield e
                        output[-1]["content"][0]["text"] += delta["content"]
                        yield event("response.output_text.delta", item_id=output[-1]["id"],
                                    output_index=len(output) - 1, content_index=0, delta=delta["content"], logprobs=[])
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):
                            for e in open_item("function_call", {
                                    "type": "function_call", "id": f"fc_{random_uuid()}", "call_id": call["id"],
                                    "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}):
                                yield e
                        if fn.get("arguments") and open_kind == "function_call":
                            output[-1]["arguments"] += fn["arguments"]
                            yield event("response.function_call_arguments.delta", item_id=output[-1]["id"],
                                        output_index=len(output) - 1, delta=fn["arguments"])
                    if choice.get("finish_reason") is not None:
                        finish = choice["finish_reason"]
            for e in close():
                yield e
            response = self._done(base, output, finish, usage, reasoning_tokens)
            if req.store:
                self.store.put(response, messages + self._answer_messages(output))
            yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                        response=response)
        finally:
            await chunks.aclose()
