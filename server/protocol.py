"""OpenAI API request / response models (with vLLM's extensions).

Every model accepts unknown fields (vLLM logs and ignores them). Stream chunks are
serialised with ``exclude_unset`` as vLLM does, so optional keys that were never set
are absent rather than null; clients accept either.
"""
from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from server.limits import (
    INT32_MAX,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def json_value_problem(value, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a request value cannot be served (None when it can): a string with a lone
    surrogate (JSON's "\\ud800" escape decodes to one; it is not Unicode, tokenizers
    reject it and no response holding it can be encoded), a number that is not finite
    (Python's JSON reads NaN / Infinity) or an integer outside 64 bits, or containers
    nested deeper than ``max_depth``. Request models inside the value check themselves."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return "contains a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not valid Unicode"
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if not _INT64_MIN <= v <= _INT64_MAX:
                return "holds an integer outside the 64-bit range"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"holds {v!r}, which is not a finite number (NaN and Infinity are not JSON)"
        elif isinstance(v, dict):
            if depth >= max_depth:
                return f"nests deeper than {max_depth} levels of objects and arrays"
            for k, x in v.items():
                stack.append((k, depth + 1))
                stack.append((x, depth + 1))
        elif isinstance(v, (list, tuple)):
            if depth >= max_depth:
                return f"nests deeper than {max_depth} levels of objects and arrays"
            if v and all(type(x) is int for x in v):  # token ids (fast path)
                if min(v) < _INT64_MIN or max(v) > _INT64_MAX:
                    return "holds an integer outside the 64-bit range"
                continue
            stack.extend((x, depth + 1) for x in v)
    return None


class RequestModel(OpenAIBaseModel):
    """A request body (or part of one): every field, and every unknown field, is
    checked by ``json_value_problem`` (HTTP 400 naming the field). Bounds that need no
    engine are in the field types (server/limits.py); ``json_schema_extra`` ranges
    document in the OpenAPI schema what SamplingParams enforces."""

    @field_validator("*", mode="after")
    @classmethod
    def _servable(cls, value, info: ValidationInfo):
        problem = json_value_problem(value)
        if problem is not None:
            raise ValueError(f"{info.field_name} {problem}")
        return value

    @model_validator(mode="after")
    def _servable_extra(self):
        for key, value in (self.model_extra or {}).items():
            problem = json_value_problem(key) or json_value_problem(value)
            if problem is not None:
                raise ValueError(f"unknown field {key!r} {problem}")
        return self


def _range(**bounds) -> dict[str, Any]:
    """OpenAPI-only bounds (JSON Schema keywords) for a field whose range another
    layer enforces (SamplingParams, the engine)."""
    return {"json_schema_extra": bounds}


# OpenAPI shapes of the free-form fields (validation stays with the serving code,
# server/structured.py, which names the field in its 400s): clients and the fuzzer
# (tests/server/test_fuzz_openapi.py) see what a served value looks like.
_NULL = {"type": "null"}
_OBJECT = {"type": "object"}
_RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "schema": _OBJECT,
            "strict": {"type": "boolean"}}}}},
    _NULL]}
_STRUCTURED_OUTPUTS_SCHEMA = {"anyOf": [
    {"type": "object", "description": "exactly one of json, regex, choice, grammar, json_object", "properties": {
        "json": {"anyOf": [_OBJECT, {"type": "string"}]}, "regex": {"type": "string", "minLength": 1},
        "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "grammar": {"type": "string", "minLength": 1}, "json_object": {"type": "boolean"},
        "disable_any_whitespace": {"type": "boolean"}, "disable_additional_properties": {"type": "boolean"},
        "whitespace_pattern": {"type": "string"}}},
    _NULL]}
_TOOLS_SCHEMA = {"anyOf": [
    {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                "parameters": _OBJECT, "strict": {"type": "boolean"}}}}}},
    _NULL]}
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    _NULL], "default": "none"}
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"anyOf": [
        {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"const": "text"}, "text": {"type": "string"}}},
        # Vision-language models only (a text model answers 400): a data: or http(s) URL.
        {"type": "object", "required": ["type", "image_url"], "properties": {
            "type": {"const": "image_url"}, "image_url": {"type": "object", "required": ["url"], "properties": {
                "url": {"type": "string"}, "detail": {"type": "string"}}}}}]}},
    _NULL]}
_TOOL_CALLS_SCHEMA = {"anyOf": [
    {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
    _NULL]}

_StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
_TokenId = Annotated[int, Field(**_range(minimum=0, maximum=INT32_MAX))]


# ----------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    weights_version: int | None = None  # bumped by every weight update (server/weight_routes.py)


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------------------- shared
class StreamOptions(RequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class _SamplingFields(RequestModel):
    """Fields completions and chat share (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = Field(0.0, **_range(minimum=-2, maximum=2))
    presence_penalty: float | None = Field(0.0, **_range(minimum=-2, maximum=2))
    logit_bias: dict[str, float] | None = None
    # At most the engine's max_num_seqs (checked by the serving code).
    n: int = Field(1, **_range(minimum=1))
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, **_range(minimum=0, maximum=2))
    top_p: float | None = Field(None, **_range(exclusiveMinimum=0, maximum=1))
    user: str | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}} (server/structured.py)
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(_RESPONSE_FORMAT_SCHEMA)] = None
    # vLLM extensions
    top_k: int | None = Field(None, **_range(minimum=-1, maximum=INT32_MAX))
    min_p: float | None = Field(None, **_range(minimum=0, maximum=1))
    repetition_penalty: float | None = Field(None, **_range(minimum=1e-6, maximum=1e6))
    ignore_eos: bool = False
    min_tokens: int = Field(0, **_range(minimum=0))
    stop_token_ids: list[_TokenId] | None = None
    allowed_token_ids: list[_TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, **_range(minimum=0))
    priority: int = 0
    cache_salt: str | None = None
    # Structured outputs (vLLM): a StructuredOutputsParams dict, or the older guided_* fields.
    structured_outputs: Annotated[dict[str, Any] | None, WithJsonSchema(_STRUCTURED_OUTPUTS_SCHEMA)] = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored
    request_id: str | None = None  # the response id's suffix (an X-Request-Id header wins)
    # Beam search (vLLM): n beams, ranked by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0


# ----------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: (list[_TokenId] | Annotated[list[list[_TokenId]], Field(max_length=MAX_PROMPTS)] | str
             | Annotated[list[str], Field(max_length=MAX_PROMPTS)])
    best_of: int | None = Field(None, **_range(minimum=1))  # only best_of == n is served
    echo: bool | None = False
    logprobs: int | None = Field(None, **_range(minimum=0))
    max_tokens: int | None = Field(16, **_range(minimum=0))
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    service_tier: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------- chat
class ChatMessageParam(RequestModel):
    role: str
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    # An assistant turn that called tools, and the tool turns that answer it.
    tool_calls: Annotated[list[dict[str, Any]] | None, WithJsonSchema(_TOOL_CALLS_SCHEMA)] = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageParam], Field(max_length=MAX_MESSAGES)]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, **_range(minimum=0))
    # deprecated by OpenAI in favour of max_completion_tokens
    max_tokens: int | None = Field(None, **_range(minimum=1))
    max_completion_tokens: int | None = Field(None, **_range(minimum=1))
    tools: Annotated[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None,
                     WithJsonSchema(_TOOLS_SCHEMA)] = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; left out:
    # "auto" when tools are given, else "none" (server/structured.py resolve_tool_choice).
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = "none"
    parallel_tool_calls: bool | None = True
    # vLLM extensions
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template already holds them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    function_call: dict[str, Any] | None = None
    # --reasoning-parser: the thinking part (vLLM's reasoning_content; newer vLLM calls it reasoning).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    service_tier: str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------- tokenization
class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _tokenize_kind(value) -> str:
    has_messages = "messages" in value if isinstance(value, dict) else hasattr(value, "messages")
    return "tokenize-chat" if has_messages else "tokenize-prompt"


# POST /tokenize's body: a chat (``messages``) or a prompt. The discriminator picks the
# model, so a 400 names the field of that model (the tags, not identifiers, are no
# field's name).
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("tokenize-chat")] | Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")],
    Discriminator(_tokenize_kind)]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[_TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ----------------------------------------------------------------------------- pooling (docs/pooling.md)
class _PoolingFields(RequestModel):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    priority: int = 0
    add_special_tokens: bool = True


class EmbeddingRequest(_PoolingFields):
    """POST /v1/embeddings (OpenAI's, with vLLM's extras): input a text, texts, token
    ids or lists of them."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(_PoolingFields):
    """POST /pooling (vLLM's): the raw pooled output of each input."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"


class ClassificationRequest(_PoolingFields):
    """POST /classify (vLLM's)."""

    input: str | list[str] | list[int] | list[list[int]]
    use_activation: bool | None = None


class ScoreRequest(_PoolingFields):
    """POST /score, /v1/score (vLLM's): text_1 against text_2, 1:N or N:N."""

    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None


class RerankRequest(_PoolingFields):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shapes, as vLLM takes them)."""

    query: str
    documents: list[str]
    top_n: int = 0  # 0 or less: all of them
    return_documents: bool = True
