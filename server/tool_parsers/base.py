"""What every tool parser shares: the result types, the per-choice streaming state and
the bookkeeping of calls (ids, names, argument fragments).

A parser's one piece of logic is a streaming state machine (``ToolStreamer.feed``);
the non-streamed extraction runs the same machine over the whole text, so streamed
deltas always add up to the non-streamed result, however the text was split.

Streamed tool calls follow OpenAI's (and vLLM's) delta shape: a call's first delta
carries ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``,
later ones ``{"index", "function": {"arguments": fragment}}``; the fragments of one
index join to the call's arguments string.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.reasoning.tags import partial_tag_suffix
from server.tool_parsers.json_stream import CallScanner, JsonError


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of ``message.tool_calls``."""
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output, parsed: the calls and the text around them (None when empty)."""

    tools_called: bool
    tool_calls: list[dict[str, Any]]
    content: str | None


@dataclass
class ToolDelta:
    """What one streamed text delta adds: content and / or tool-call deltas."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class _Call:
    index: int
    id: str
    name: str | None = None
    arguments: str = ""  # everything known so far (sent or waiting for the name)
    sent: int = 0  # characters of ``arguments`` already streamed
    header_sent: bool = False
    complete: bool = False
    failed: bool = False


class ToolStreamer:
    """Per-choice streaming state. ``feed(delta, final=...)`` returns a ToolDelta.

    Content is released without trailing whitespace (held until more text follows) so
    that the whitespace around tool calls never reaches the client; at the end it is
    released only when no call was made. Subclasses implement ``_step``."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._buf = ""  # text received and not yet consumed by the state machine
        self._held_ws = ""
        self._emitted = False  # some content has been released
        self._content_parts: list[str] = []  # content released this feed
        self._deltas: dict[int, dict[str, Any]] = {}  # tool-call deltas this feed, by index
        self._passthrough = False  # a malformed call: everything from here on is content
        self._scanner: CallScanner | None = None
        self._call_raw = ""  # raw text of the call being scanned (returned as content if it fails)

    # ------------------------------------------------------------------ public
    def feed(self, delta: str, *, final: bool = False) -> ToolDelta:
        self._buf += delta or ""
        if self._passthrough:
            self._content(self._buf)
            self._buf = ""
        else:
            self._step(final)
        if final:
            if self._scanner is not None:  # the output ended inside a call
                self._fail_call()
            if self._buf:
                self._content(self._buf)
                self._buf = ""
            if not self.successful_calls():
                self._content_parts.append(self._held_ws)
            self._held_ws = ""
        out = ToolDelta(content="".join(self._content_parts), tool_calls=list(self._deltas.values()))
        self._content_parts, self._deltas = [], {}
        return out

    def successful_calls(self) -> list[_Call]:
        return [c for c in self.calls if c.complete and not c.failed]

    def extract(self, text: str) -> ExtractedToolCalls:
        """Run the machine over a whole output (a fresh streamer)."""
        out = self.feed(text, final=True)
        calls = [tool_call(c.name, c.arguments, c.id) for c in self.successful_calls()]
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, out.content or None)

    # ------------------------------------------------------------------ for subclasses
    def _step(self, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if not text:
            return
        text = self._held_ws + text
        if not self._emitted and self.successful_calls():
            text = text.lstrip()  # content that starts after a call: no leading whitespace either
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        if kept:
            self._content_parts.append(kept)
            self._emitted = True

    def _start_call(self, raw_prefix: str) -> None:
        """A call starts here; ``raw_prefix`` is its opening text (a tag, or "")."""
        self._scanner = CallScanner()
        self._call_raw = raw_prefix
        self.calls.append(_Call(index=len(self.calls), id=make_tool_call_id()))

    def _scan(self) -> bool:
        """Feed the buffer to the open call. True when the call is complete (the buffer
        then starts after it); False when it needs more text or failed."""
        scanner = self._scanner
        try:
            used, events = scanner.feed(self._buf)
        except JsonError:
            self._call_raw += self._buf
            self._buf = ""
            self._fail_call()
            return False
        self._call_raw += self._buf[:used]
        self._buf = self._buf[used:]
        if scanner.done:
            events += scanner.finish()
        self._events(events)
        if not scanner.done:
            return False
        call = self.calls[-1]
        call.complete = True
        self._scanner = None
        self._call_raw = ""
        return True

    def _events(self, events: list[tuple[str, str]]) -> None:
        call = self.calls[-1]
        for kind, value in events:
            if kind == "name":
                call.name = value
            else:
                call.arguments += value
        if call.name is None:
            return
        if not call.header_sent:
            call.header_sent = True
            self._deltas[call.index] = {"index": call.index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}
        if len(call.arguments) > call.sent:
            fragment = call.arguments[call.sent:]
            call.sent = len(call.arguments)
            entry = self._deltas.setdefault(call.index, {"index": call.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += fragment

    def _open_call(self, name: str) -> None:
        """A call whose name is known, written in a format the JSON scanner does not read:
        its header goes out now, its arguments through ``_send_arguments``."""
        self._start_call("")
        self._scanner = None
        self._events([("name", name)])

    def _send_arguments(self, fragment: str, *, complete: bool = False) -> None:
        """More of the open call's canonical arguments text; ``complete`` closes the call."""
        self._events([("arguments", fragment)])
        if complete:
            self.calls[-1].complete = True

    def _send_call(self, name: str, arguments: dict) -> None:
        """A call known whole: header and canonical JSON arguments in one delta."""
        self._open_call(name)
        self._send_arguments(json.dumps(arguments, ensure_ascii=False), complete=True)

    def _fail_call(self) -> None:
        """The open call is not a valid call: it and everything after it are content."""
        self.calls[-1].failed = True
        self._scanner = None
        self._passthrough = True
        self._content(self._call_raw + self._buf)
        self._call_raw, self._buf = "", ""


class ToolParser:
    """A model's tool-call format. Stateless: ``streamer()`` makes the per-choice state."""

    name = ""
    streamer_class: type[ToolStreamer] = ToolStreamer

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def streamer(self, tools: list[dict] | None = None) -> ToolStreamer:
        """The per-choice state; ``tools``: the request's tools (for formats whose
        arguments are typed by the schema)."""
        return self.streamer_class()

    def extract_tool_calls(self, text: str, tools: list[dict] | None = None) -> ExtractedToolCalls:
        return self.streamer(tools).extract(text)

    def skip_special_tokens(self, skip: bool) -> bool:
        """The request's skip_special_tokens when this parser reads its output (a format
        whose markers are special tokens must see them)."""
        return skip


def json_object(text: str) -> dict | None:
    """``text`` parsed as a JSON object, or None (not JSON, or not an object)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# The reasoning parsers' helper (a tag split across deltas), under the tool parsers' name.
partial_prefix_len = partial_tag_suffix
