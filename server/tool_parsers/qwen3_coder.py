"""Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder`` parser)::

    I'll check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one leading and one trailing newline dropped), typed by
the request's tool schema: strings stay strings; integer / number / boolean / null,
objects and arrays are parsed (a value that does not parse stays a string, as vLLM
keeps it); a parameter the schema does not name is a string. The call's header is
streamed when ``<function=name>`` is whole, each parameter when it closes. A
``<tool_call>`` may be missing (a bare ``<function=``); a missing ``</parameter>`` is
tolerated before the next parameter or ``</function>``. An output that ends inside a
call, or a call with stray text between parameters, is content from that call on.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from jaxserve.reasoning.tags import first_tag
from server.tool_parsers.base import ToolParser, ToolStreamer, partial_prefix_len

CALL, CALL_END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_MAX_NAME = 256


def _schema_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON-schema type (str, list or None)}}."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = fn.get("name")
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(name, str) and isinstance(props, dict):
            out[name] = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return out


def convert_value(raw: str, schema_type: Any) -> Any:
    """A parameter's text -> its JSON value under ``schema_type`` (vLLM's rules)."""
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    types = [t.lower() for t in types if isinstance(t, str)]
    if not types or any(t in ("string", "str", "text") for t in types):
        if "null" in types and raw.strip().lower() == "null":
            return None
        return raw
    text = raw.strip()
    if "null" in types and text.lower() == "null":
        return None
    for t in types:
        if t in ("integer", "int"):
            try:
                return int(text)
            except ValueError:
                continue
        if t in ("number", "float"):
            try:
                number = float(text)
            except ValueError:
                continue
            if number.is_integer() and "." not in text and "e" not in text.lower():
                return int(number)
            return number
        if t in ("boolean", "bool") and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t in ("object", "array"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                try:
                    return ast.literal_eval(text)  # Python literals (True, single quotes)
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    continue
    return raw


class Qwen3CoderToolStreamer(ToolStreamer):
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._types = _schema_types(tools)
        # "text" | "open" (after <tool_call>) | "body" (in a function) | "value" | "after"
        self._state = "text"
        self._param: str | None = None
        self._nparams = 0

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "text":
                i, tag = first_tag(self._buf, (CALL, FUNC))
                if i < 0:
                    hold = 0 if final else partial_prefix_len(self._buf, (CALL, FUNC))
                    self._content(self._buf[: len(self._buf) - hold])
                    self._buf = self._buf[len(self._buf) - hold:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i:]
                self._call_raw = ""
                if tag == CALL:
                    self._take(len(CALL))
                    self._state = "open"
                elif not self._function_header(final):
                    return
            elif self._state == "open":
                stripped = self._buf.lstrip()
                if not stripped or (FUNC.startswith(stripped) and not final):
                    return
                if not stripped.startswith(FUNC):
                    self._fail()
                    return
                self._take(len(self._buf) - len(stripped))
                if not self._function_header(final):
                    return
            elif self._state == "body":
                stripped = self._buf.lstrip()
                if not stripped or ((PARAM.startswith(stripped) or FUNC_END.startswith(stripped)) and not final):
                    if final:
                        self._fail()
                    return
                self._take(len(self._buf) - len(stripped))
                if stripped.startswith(FUNC_END):
                    self._take(len(FUNC_END))
                    self._close_function()
                elif stripped.startswith(PARAM):
                    end = self._buf.find(">")
                    if end < 0:
                        if final or len(self._buf) > _MAX_NAME:
                            self._fail()
                        return
                    name = self._buf[len(PARAM):end].strip()
                    if not name or "<" in name:
                        self._fail()
                        return
                    self._take(end + 1)
                    self._param, self._state = name, "value"
                else:
                    self._fail()
            elif self._state == "value":
                i, tag = first_tag(self._buf, (PARAM_END, PARAM, FUNC_END))
                if i < 0:
                    if final:
                        self._fail()
                    return
                self._send_param(self._buf[:i])
                self._take(i + (len(PARAM_END) if tag == PARAM_END else 0))
                self._state = "body"
            else:  # after </function>: whitespace, then </tool_call> (optional)
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    return
                if stripped.startswith(CALL_END):
                    self._buf = stripped[len(CALL_END):]
                elif CALL_END.startswith(stripped) and not final:
                    self._buf = stripped
                    return
                else:
                    self._buf = stripped
                self._state = "text"
        if final and not self._passthrough and self._state in ("open", "body", "value"):
            self._fail()  # the output ended inside a call
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""

    # ------------------------------------------------------------------ pieces
    def _take(self, n: int) -> None:
        """Consume ``n`` characters of the buffer as part of the open call's raw text."""
        self._call_raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _function_header(self, final: bool) -> bool:
        """The buffer starts with <function=: open the call once the name is whole."""
        end = self._buf.find(">")
        if end < 0:
            if final or len(self._buf) > _MAX_NAME:
                self._fail()
            return False
        name = self._buf[len(FUNC):end].strip()
        if not name or any(c in name for c in " \n<\"'"):
            self._fail()
            return False
        self._take(end + 1)
        raw = self._call_raw
        self._open_call(name)
        self._call_raw = raw
        self._nparams, self._state = 0, "body"
        return True

    def _send_param(self, raw: str) -> None:
        value = raw.removeprefix("\n").removesuffix("\n")
        call = self.calls[-1]
        value = convert_value(value, self._types.get(call.name, {}).get(self._param))
        text = json.dumps(self._param, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        self._send_arguments(("{" if self._nparams == 0 else ", ") + text)
        self._nparams += 1

    def _close_function(self) -> None:
        self._send_arguments("{}" if self._nparams == 0 else "}", complete=True)
        self._call_raw = ""
        self._state = "after"

    def _fail(self) -> None:
        """Not a (whole) call: its raw text and the rest are content."""
        if self.calls and not self.calls[-1].complete:
            self._fail_call()
        else:  # no call was opened yet (a broken <tool_call> / <function= header)
            self._passthrough = True
            self._content(self._call_raw + self._buf)
            self._call_raw, self._buf = "", ""


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    streamer_class = Qwen3CoderToolStreamer

    def streamer(self, tools: list[dict] | None = None) -> ToolStreamer:
        return Qwen3CoderToolStreamer(tools)

    def skip_special_tokens(self, skip: bool) -> bool:
        return False  # <tool_call> is a special token in Qwen3-Coder's tokenizer
