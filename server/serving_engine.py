"""OpenAIServing: what the completion, chat and tokenization endpoints share — model
check, chat rendering, sampling parameters from a request, length checks, merging the
output streams of several prompts."""
from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.multimodal.chat import split_content
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from server.errors import (
    APIError,
    bad_request,
    engine_dead,
    engine_error,
    error_event,
    guess_param,
)
from server.limits import ServerLimits
from server.protocol import UsageInfo, random_uuid
from server.structured import Constraint

logger = logging.getLogger("jaxserve.server")

# The W3C trace context (traceparent / tracestate) of the HTTP request being served: set
# by the route (server/app.py), read where a handler hands a request to the engine.
TRACE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("jaxserve_trace_headers", default=None)

# JSON has no -inf: vLLM clamps logprobs to this.
MIN_LOGPROB = -9999.0


def clamp_logprob(x: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, from a row whose grammar allowed no
    token) becomes MIN_LOGPROB."""
    x = float(x)
    if math.isnan(x):
        return MIN_LOGPROB
    return min(max(x, MIN_LOGPROB), 0.0) if math.isinf(x) else max(x, MIN_LOGPROB)


class OpenAIServing:
    def __init__(self, engine_client: AsyncLLM, served_model_name: str, *, max_model_len: int,
                 enable_prompt_tokens_details: bool = False,
                 default_sampling_params: dict[str, Any] | None = None,
                 chat_template: str | None = None, limits: ServerLimits | None = None,
                 lora_registry=None) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        # The LoRA adapters a request's model field can name (server/lora_routes.py); None: LoRA off.
        self.lora_registry = lora_registry
        self.max_model_len = max_model_len
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        # The model's generation-config defaults (ModelConfig.get_diff_sampling_param):
        # they fill the sampling fields a request leaves out, before OpenAI's defaults.
        self.default_sampling_params = dict(default_sampling_params or {})
        # --chat-template: used when a request names none (else the tokenizer's own).
        self.chat_template = chat_template
        self.limits = limits or ServerLimits()
        # n (choices per prompt) is at most the engine's max_num_seqs: one request's
        # choices never need more than a whole batch (vLLM: VLLM_MAX_N_SEQUENCES).
        scheduler_config = getattr(getattr(engine_client, "config", None), "scheduler_config", None)
        self.max_n: int | None = getattr(scheduler_config, "max_num_seqs", None)

    @property
    def tokenizer(self):
        return self.engine_client.get_tokenizer()

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None):
        """The LoRA adapter ``model`` names (a LoRARequest), None for the base model; 404
        for any other name."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.lora_registry.get(model) if self.lora_registry is not None else None
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")
        return lora

    def model_name(self, request) -> str:
        """The response's model field: the adapter's name for an adapter's request (as vLLM)."""
        model = getattr(request, "model", None)
        if model and self.lora_registry is not None and self.lora_registry.get(model) is not None:
            return model
        return self.served_model_name

    def check_engine(self) -> None:
        if self.engine_client.errored:
            raise engine_dead("The engine is dead; restart the server.")

    def check_capacity(self, num_seqs: int, param: str = "n") -> None:
        """503 with Retry-After when the engine has more waiting than it accepts (before
        a stream starts, so a streaming client gets the status too)."""
        try:
            self.engine_client.check_capacity(num_seqs)
        except ValueError as e:  # more sequences than the server ever takes at once
            raise bad_request(str(e), param) from e
        except Exception as e:  # noqa: BLE001 — EngineOverloadedError; mapped like any engine error
            raise engine_error(e) from e

    @staticmethod
    def check_stream_options(request) -> None:
        if request.stream_options is not None and not request.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")

    @staticmethod
    def stream_usage_options(request) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) from the request's stream_options."""
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        return include_usage, include_usage and bool(opts.continuous_usage_stats)

    async def beam_search(self, token_ids: list[int], request, max_tokens: int, engine_id: str, lora):
        """The request's ``n`` best beams (jaxserve/beam_search.py) for one prompt, best first."""
        from jaxserve.beam_search import BeamSearchParams, beam_search_async

        if request.stream:
            raise bad_request("use_beam_search does not stream; leave stream off", "stream")
        width, limit = 2 * request.n, getattr(self.engine_client.model_config, "max_logprobs", 20)
        if width > limit:
            raise bad_request(f"n must be at most {limit // 2} with use_beam_search (each step asks for 2 * n "
                              f"logprobs; max_logprobs={limit})", "n")
        params = BeamSearchParams(beam_width=request.n, max_tokens=max_tokens, ignore_eos=request.ignore_eos,
                                  length_penalty=request.length_penalty)
        try:
            results = await beam_search_async(
                self.engine_client, [token_ids], params, eos_token_id=self.engine_client.input_processor.primary_eos,
                max_len=self.max_model_len, request_id=engine_id, lora_request=lora, priority=request.priority)
        except ValueError as e:
            raise bad_request(str(e), guess_param(str(e), type(request).model_fields)) from e
        sequences = results[0].sequences
        for seq in sequences:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=request.skip_special_tokens)
        return sequences

    @staticmethod
    def request_ids(prefix: str, request, raw_request) -> tuple[str, str]:
        """(response id, engine request id). The response id is ``prefix-`` plus the
        client's X-Request-Id header, else the body's request_id, else a random id (as in
        vLLM). A client-chosen id may repeat, so the engine's id adds a random suffix."""
        given = raw_request.headers.get("x-request-id") if raw_request is not None else None
        given = given or getattr(request, "request_id", None)
        if not given:
            rid = f"{prefix}-{random_uuid()}"
            return rid, rid
        rid = f"{prefix}-{given}"
        return rid, f"{rid}-{random_uuid()[:8]}"

    def check_length(self, prompt_len: int, max_tokens: int, *, param: str = "max_tokens",
                     prompt_param: str = "prompt") -> None:
        """prompt + max_tokens must fit in max_model_len (OpenAI's rule; HTTP 400)."""
        m = self.max_model_len
        if prompt_len >= m:
            raise bad_request(
                f"This model's maximum context length is {m} tokens. However, your request has {prompt_len} "
                f"input tokens. Please reduce the length of the input {prompt_param}.", prompt_param)
        if max_tokens > m:
            raise bad_request(
                f"{param}={max_tokens} cannot be greater than max_model_len={m}. Please request fewer output tokens.",
                param)
        if prompt_len + max_tokens > m:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {m} tokens and your request has {prompt_len} input tokens "
                f"({max_tokens} > {m} - {prompt_len}).", param)

    # ------------------------------------------------------------------ inputs
    def validate_inputs(self, prompt_token_ids: list[int], params: SamplingParams, fields,
                        constraint: Constraint | None = None) -> None:
        """The engine's own input checks (vocabulary, logprobs limits, the grammar of a
        constraint), as HTTP 400. A grammar error ("structured_outputs.<kind>: ...") names
        the field the constraint came from (response_format, tools, ...)."""
        try:
            self.engine_client.process_inputs(prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            msg = str(e)
            if constraint is not None and msg.startswith("structured_outputs"):
                raise bad_request(msg, constraint.param) from e
            raise bad_request(msg, guess_param(msg, fields)) from e

    @property
    def mm_processor(self):
        """The model's image processor (jaxserve/multimodal/processor.py), None for a text model."""
        return getattr(self.engine_client.input_processor, "mm_processor", None)

    def load_images(self, images: list) -> list:
        """(where, URL) pairs -> decoded RGB images, under the server's media rules; a
        400 naming the part for a blocked URL, an unreadable image or too many. Blocking
        (fetches, decodes): call it on a worker thread. A URL must be a string here."""
        from jaxserve.multimodal.image import load_image
        from jaxserve.multimodal.media import MediaPolicy

        limit = self.mm_processor.limit_per_prompt
        if len(images) > limit:
            raise bad_request(f"at most {limit} images per prompt are accepted (--limit-mm-per-prompt), "
                              f"got {len(images)}.", "messages")
        policy = MediaPolicy(allowed_domains=self.limits.allowed_media_domains,
                             allowed_local_path=self.limits.allowed_local_media_path)
        out = []
        for where, url in images:
            try:
                if not isinstance(url, str):
                    raise ValueError("image_url.url must be a string")
                out.append(load_image(policy.fetch(url)))
            except ValueError as e:
                raise bad_request(f"{where}: {e}", "messages") from e
        return out

    def expand_images(self, ids: list[int], images: list):
        """Token ids with one placeholder per image -> (expanded ids, MultiModalPrompt);
        a 400 when they do not match. Blocking (preprocessing): a worker thread's."""
        try:
            return self.mm_processor.process(ids, images)
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    def tokenize_prompt(self, prompt, *, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        try:
            return self.engine_client.input_processor.tokenize(
                {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt,
                add_special_tokens=add_special_tokens)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), "prompt") from e

    @staticmethod
    def message_dicts(messages, images: list | None = None) -> list[dict[str, Any]]:
        """Pydantic messages -> template dicts; text parts are joined with newlines.
        ``images``: for a vision-language model, a list that receives each image_url
        part's URL in order, its place in the message kept as an {"type": "image"} part
        (what the model's chat template turns into its image placeholder); None: image
        parts are a 400."""
        out = []
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                try:
                    d["content"] = split_content(content, f"messages[{i}]", images)
                except ValueError as e:
                    raise bad_request(str(e), "messages") from e
            elif content is None:
                d["content"] = ""
            if m.tool_calls:
                d["tool_calls"] = [OpenAIServing._template_tool_call(i, c) for c in m.tool_calls]
            out.append(d)
        return out

    @staticmethod
    def _template_tool_call(i: int, call: dict[str, Any]) -> dict[str, Any]:
        """A history tool call for the chat template: arguments as a dict, not a JSON
        string (what tool-use templates expect; vLLM converts them the same way)."""
        call = dict(call)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls: each call needs function.name.", "messages")
        fn = dict(fn)
        args = fn.get("arguments")
        if not args:
            fn["arguments"] = {}
        elif isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError as e:
                raise bad_request(f"messages[{i}].tool_calls: arguments are not valid JSON: {e}", "messages") from e
        call["function"] = fn
        return call

    def render_chat(self, request, images: list | None = None) -> str:
        """Apply the chat template (HTTP 400 when the template rejects the conversation).
        A request's own chat_template only with --trust-request-chat-template.
        ``images``: receives the image parts (message_dicts)."""
        if request.chat_template is not None and not self.limits.trust_request_chat_template:
            raise bad_request("A chat_template was passed with the request, but the server does not run a client's "
                              "template (start it with --trust-request-chat-template to allow that).",
                              "chat_template")
        if not request.messages:
            raise bad_request("messages must not be empty.", "messages")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        kwargs = dict(request.chat_template_kwargs or {})
        tools = getattr(request, "tools", None)
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                self.message_dicts(request.messages, images), tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template or self.chat_template, **kwargs)
        except APIError:
            raise
        except Exception as e:  # a jinja error is the client's conversation
            raise bad_request(f"The chat template could not be applied: {e}", "messages") from e
        if not isinstance(text, str):  # some tokenizers return a list when batched
            text = text[0]
        return text

    # ------------------------------------------------------------------ sampling params
    def default_max_tokens(self, prompt_len: int) -> int:
        """max_tokens when the request gives none: the rest of the context (vLLM),
        capped by the generation config's max_new_tokens."""
        rest = self.max_model_len - prompt_len
        cap = self.default_sampling_params.get("max_tokens")
        return rest if cap is None else min(rest, cap)

    def sampling_params(self, request, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        constraint: Constraint | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        def field(name: str, openai_default):
            # The request's value, else the model's generation-config default, else OpenAI's.
            value = getattr(request, name)
            return value if value is not None else self.default_sampling_params.get(name, openai_default)

        if self.max_n is not None and request.n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n} (the server's max_num_seqs), got {request.n}.", "n")
        try:
            return SamplingParams(
                n=request.n,
                presence_penalty=request.presence_penalty if request.presence_penalty is not None else 0.0,
                frequency_penalty=request.frequency_penalty if request.frequency_penalty is not None else 0.0,
                repetition_penalty=field("repetition_penalty", 1.0),
                temperature=field("temperature", 1.0),
                top_p=field("top_p", 1.0),
                top_k=field("top_k", 0),
                min_p=field("min_p", 0.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens if skip_special_tokens is None
                else skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                structured_outputs=constraint.params if constraint is not None else None,
                logit_bias=request.logit_bias,
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
            )
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), guess_param(str(e), type(request).model_fields)) from e

    # ------------------------------------------------------------------ outputs
    def usage_details(self, num_cached_tokens: int):
        from server.protocol import PromptTokenUsageInfo

        return PromptTokenUsageInfo(cached_tokens=num_cached_tokens) if self.enable_prompt_tokens_details else None

    def final_usage(self, num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int) -> UsageInfo:
        """The usage a stream sends last (stream_options.include_usage). prompt_tokens_details
        is set only when enabled, so that otherwise it stays unset (left out of the chunk)."""
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated_tokens,
                          total_tokens=num_prompt_tokens + num_generated_tokens)
        details = self.usage_details(num_cached_tokens)
        if details is not None:
            usage.prompt_tokens_details = details
        return usage

    @staticmethod
    def prompt_logprobs_json(prompt_logprobs) -> list | None:
        """[None | {token_id: Logprob}] -> JSON-ready (vLLM's shape)."""
        if prompt_logprobs is None:
            return None
        return [None if d is None else {
            tid: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in d.items()} for d in prompt_logprobs]

    @staticmethod
    def sse(payload) -> str:
        if hasattr(payload, "model_dump_json"):
            return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"
        return f"data: {json.dumps(payload)}\n\n"


async def collect_outputs(merged: AsyncGenerator[tuple[int, RequestOutput], None],
                          on_output: Callable[[int, RequestOutput], None]) -> None:
    """A non-streaming response's loop: hand each (prompt index, output) of ``merged`` to
    ``on_output`` until every request has finished. A failure that is not already an
    APIError becomes one (503 when the engine is dead, else 500); ``merged`` is closed
    in any case (aborting what is still running)."""
    try:
        async for i, out in merged:
            on_output(i, out)
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from e
    finally:
        await merged.aclose()


async def sse_stream(kind: str, request_id: str, chunks: AsyncGenerator[str, None],
                     merged: AsyncGenerator[tuple[int, RequestOutput], None]) -> AsyncIterator[str]:
    """A streaming response: the SSE ``chunks``, then ``data: [DONE]``.

    The first chunk (it comes with the first engine output) is awaited here, before the
    status goes out, so a failure until then has its own status: a request refused as
    overloaded when it registers (another took the last place after check_capacity), a
    grammar that does not compile, a dead engine. After that the status (200) has gone
    out, and a failure is reported as an error event in the stream. ``merged`` (what
    ``chunks`` reads) is closed in any case, aborting what is still running."""
    started = False
    try:
        first = await anext(chunks, None)
        started = True
    except Exception as e:
        raise engine_error(e) from e
    finally:
        if not started:  # failed or cancelled (the client went away): abort the requests
            await chunks.aclose()
            await merged.aclose()
    return _sse_events(kind, request_id, first, chunks, merged)


async def _sse_events(kind: str, request_id: str, first: str | None, chunks: AsyncGenerator[str, None],
                      merged: AsyncGenerator[tuple[int, RequestOutput], None]) -> AsyncIterator[str]:
    try:
        if first is not None:
            yield first
            async for chunk in chunks:
                yield chunk
    except Exception as e:  # noqa: BLE001
        logger.warning("%s stream %s failed: %r", kind, request_id, e)
        yield error_event(e)
    finally:
        await chunks.aclose()
        await merged.aclose()
    yield "data: [DONE]\n\n"


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators: yields (iterator index, item) as items arrive.
    Closing the merged iterator cancels and closes every source (aborting its request)."""
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            try:
                await it.aclose()
            except RuntimeError:  # still running in a cancelled task; its own finally aborts it
                pass
