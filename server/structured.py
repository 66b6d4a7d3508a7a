"""Request fields -> the engine's StructuredOutputsParams, and tool_choice resolution.

Sources of a constraint (vLLM's, all on both /v1/completions and /v1/chat/completions):

- ``response_format``: {"type": "text"} (none), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
- ``structured_outputs``: vLLM's dict (json / regex / choice / grammar / json_object
  plus the options disable_any_whitespace, disable_additional_properties,
  whitespace_pattern). With a non-text response_format it may carry options only;
- the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  / ``guided_whitespace_pattern`` (used when structured_outputs is absent;
  ``guided_decoding_backend`` is ignored);
- chat ``tool_choice``: "required" -> an array of calls (``tool_call_array_schema``),
  a named function -> that function's parameters schema.

Every error is an APIError 400 whose ``param`` is the field the client used.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams
from server.errors import bad_request

logger = logging.getLogger("jaxserve.server")

_SO_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
_SO_KINDS = StructuredOutputsParams.KINDS
_SO_OPTIONS = _SO_FIELDS - set(_SO_KINDS)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
_UNSUPPORTED_KINDS = ("structural_tag",)


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the request field it came from (the 400's param)."""

    params: StructuredOutputsParams
    param: str


def _build(kwargs: dict[str, Any], param: str) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**kwargs), param)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param) from e


def _has_kind(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(k) not in (None, False) for k in _SO_KINDS)


def _structured_outputs_kwargs(request) -> tuple[dict[str, Any], str | None]:
    """The structured_outputs dict (or the guided_* fields) as StructuredOutputsParams
    keyword arguments, and the field they came from."""
    so = getattr(request, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object.", "structured_outputs")
        for kind in _UNSUPPORTED_KINDS:
            if so.get(kind) is not None:
                raise bad_request(f"structured_outputs.{kind} is not supported by jaxserve.", "structured_outputs")
        unknown = sorted(set(so) - _SO_FIELDS)
        if unknown:
            logger.info("structured_outputs: ignoring %s", ", ".join(unknown))
        return {k: v for k, v in so.items() if k in _SO_FIELDS and v is not None}, "structured_outputs"
    kwargs, first = {}, None
    for name, key in _GUIDED.items():
        value = getattr(request, name, None)
        if value is not None:
            kwargs[key] = value
            first = first or name
    return kwargs, first


def structured_outputs_from_request(request) -> Constraint | None:
    """The constraint response_format / structured_outputs / guided_* ask for, or None."""
    so_kwargs, so_param = _structured_outputs_kwargs(request)
    rf = getattr(request, "response_format", None)
    rf_kwargs: dict[str, Any] | None = None
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad_request("response_format must be an object.", "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            rf_kwargs = {"json_object": True}
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad_request("When response_format type is 'json_schema', the 'json_schema' field must be "
                                  "provided.", "response_format")
            schema = js.get("schema")
            if not isinstance(schema, (dict, str)):
                raise bad_request("response_format.json_schema.schema must be a JSON schema.", "response_format")
            rf_kwargs = {"json": schema}
        elif kind in _UNSUPPORTED_KINDS:
            raise bad_request(f"response_format type {kind!r} is not supported by jaxserve.", "response_format")
        elif kind != "text":
            raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                              "response_format")
    if rf_kwargs is not None:
        if so_param is not None and _has_kind(so_kwargs):
            raise bad_request(f"response_format and {so_param} both ask for a constraint; set only one.",
                              "response_format")
        # structured_outputs may still carry options (disable_any_whitespace, ...).
        options = {k: v for k, v in so_kwargs.items() if k in _SO_OPTIONS}
        return _build({**options, **rf_kwargs}, "response_format")
    if so_param is None or not so_kwargs:
        return None
    if not _has_kind(so_kwargs):
        raise bad_request(f"{so_param}: one of json, regex, choice, grammar or json_object must be set.", so_param)
    return _build(so_kwargs, so_param)


# ----------------------------------------------------------------------------- tools
def validate_tools(tools) -> list[dict[str, Any]] | None:
    """Checks the shape of ``tools`` (400 ``tools``); returns them."""
    if tools is None:
        return None
    if not tools:
        raise bad_request("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                          "entirely.", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string.", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
    return tools


def resolve_tool_choice(request, *, auto_enabled: bool) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function) for a chat request,
    with vLLM's checks and messages (400 ``tool_choice`` / ``tools``). tool_choice left
    out means "auto" when tools are given, else "none"."""
    tools = validate_tools(request.tools)
    choice = request.tool_choice if "tool_choice" in request.model_fields_set else None
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none", None
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}", "tool_choice")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}", "tool_choice")
        if not any(t["function"]["name"] == name for t in tools):
            raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              "tool_choice")
        return "named", name
    if choice == "required":
        return "required", None
    if choice == "auto":
        if not auto_enabled:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set", "tool_choice")
        return "auto", None
    raise bad_request(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                      "\"required\" are supported.", "tool_choice")


_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(tool["function"].get("parameters") or _EMPTY_PARAMETERS)


def tool_call_array_schema(tools: list[dict[str, Any]], *, parallel: bool = True) -> dict[str, Any]:
    """tool_choice="required" (vLLM's schema): a non-empty array whose items are
    ``{"name": <one tool's name>, "parameters": <that tool's parameters>}`` (at most one
    item when not ``parallel``: parallel_tool_calls=false). Each tool's ``$defs`` move to
    the top, where their ``#/$defs/...`` references resolve. Unlike vLLM's, an item takes
    no other keys: a call is its name and parameters, and a small model otherwise goes on
    writing keys (a "description" ...) until max_tokens."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = _parameters(tool)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
            defs[name] = schema
        variants.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_constraint(tools: list[dict[str, Any]], mode: str, name: str | None, *,
                    parallel: bool = True) -> Constraint | None:
    """The constraint tool_choice asks for: "required" -> tool_call_array_schema, a named
    function -> its parameters schema; None otherwise."""
    if mode == "required":
        return _build({"json": tool_call_array_schema(tools, parallel=parallel)}, "tools")
    if mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == name)
        return _build({"json": _parameters(tool)}, "tools")
    return None


def chat_constraint(request, mode: str, name: str | None) -> Constraint | None:
    """A chat request's constraint: from tool_choice (required / named) or from
    response_format / structured_outputs; both at once is a 400, as in vLLM."""
    requested = structured_outputs_from_request(request)
    forced = None
    if mode in ("required", "named"):
        forced = tool_constraint(request.tools, mode, name, parallel=request.parallel_tool_calls is not False)
    if forced is not None and requested is not None:
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.",
                          "tool_choice")
    return forced or requested
