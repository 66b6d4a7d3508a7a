"""Python-call tool calls (vLLM's ``pythonic`` parser; Llama 3.2 / 4 and others)::

    [get_weather(city="Paris", unit="celsius"), ping()]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

The output is tool calls when it starts (after whitespace, and an optional
``<|python_start|>``) with ``[``: a list of calls whose arguments are keywords with
literal values (strings, numbers, booleans, None, lists, dicts). The list is parsed
with Python's ``ast`` once it closes, and its calls are sent then; text after it is
content. Anything else (or a list that is not of such calls) is content.
"""
from __future__ import annotations

import ast
import json

from server.tool_parsers.base import ToolParser, ToolStreamer
from server.tool_parsers.mistral import balanced_end

START, END = "<|python_start|>", "<|python_end|>"


def parse_calls(source: str) -> list[tuple[str, dict]] | None:
    """``[f(a=1), g()]`` -> [(name, arguments)]; None when it is not such a list."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        calls.append((name, args))
    return calls


class PythonicToolStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "list" | "after"
        self._prefix = ""  # <|python_start|> and whitespace before the list, as written

    def _step(self, final: bool) -> None:
        while self._buf and not self._passthrough:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    self._prefix += self._buf
                    self._buf = ""
                    return
                if stripped.startswith(START):
                    self._prefix += self._buf[: len(self._buf) - len(stripped)] + START
                    self._buf = stripped[len(START):]
                    continue
                if START.startswith(stripped) and not final:
                    return
                if stripped[0] != "[":
                    self._buf = self._prefix + self._buf
                    self._passthrough = True
                    break
                self._prefix += self._buf[: len(self._buf) - len(stripped)]
                self._buf, self._state = stripped, "list"
            elif self._state == "list":
                end = balanced_end(self._buf, "[", "]")
                if end < 0:
                    if final:
                        self._buf = self._prefix + self._buf
                        self._passthrough = True
                        break
                    return
                calls = parse_calls(self._buf[:end])
                if calls is None:
                    self._buf = self._prefix + self._buf
                    self._passthrough = True
                    break
                for name, args in calls:
                    self._start_call("")
                    self._scanner = None
                    self._events([("name", name), ("arguments", json.dumps(args, ensure_ascii=False))])
                    self.calls[-1].complete = True
                self._buf, self._state = self._buf[end:], "after"
            else:  # after the list: the closing tag, then content
                stripped = self._buf.lstrip()
                if stripped.startswith(END):
                    self._buf = stripped[len(END):]
                elif END.startswith(stripped) and stripped and not final:
                    return
                self._passthrough = True
        if final and self._state == "start" and not self._passthrough and self._prefix:
            self._content(self._prefix)  # whitespace (or a lone start tag) and nothing else
            self._prefix = ""
        if self._passthrough and self._buf:
            self._content(self._buf)
            self._buf = ""


class PythonicToolParser(ToolParser):
    name = "pythonic"
    streamer_class = PythonicToolStreamer

    def skip_special_tokens(self, skip: bool) -> bool:
        return False  # <|python_start|> / <|python_end|> are special tokens
