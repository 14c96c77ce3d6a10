"""The request fields that constrain the output: ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``
extensions, and ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (chat only).

Each becomes a :class:`~lightning_llmopt.inference.structured_output.StructuredOutput` for the engine and, for tools,
a :class:`~.tool_calls.ToolPlan` for the response; a bad shape raises :class:`FieldError` naming the field (a 400).
At most one constraint is given per request: ``response_format`` (other than ``text``), one ``guided_*`` key,
``structured_outputs``, or ``tool_choice`` ``"required"``/named.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_llmopt.inference.serving.tool_calls import ToolParser, ToolPlan, parameters_schema, required_schema
from lightning_llmopt.inference.structured_output import StructuredOutput

__all__ = [
    "CONSTRAINT_FIELDS", "TOOL_FIELDS", "Constraint", "FieldError", "ToolRequest", "parse_constraint", "parse_tools",
]  # fmt: skip

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
_OUTPUTS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}  # fmt: skip
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED})
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class FieldError(ValueError):
    """A bad field: :mod:`.protocol` answers it as a 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _bad(param: str, message: str) -> FieldError:
    return FieldError(param, message)


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field it came from (named in the 400 if the engine refuses it)."""

    output: StructuredOutput
    param: str


def _build(param: str, **kwargs: Any) -> Constraint:
    try:
        return Constraint(StructuredOutput(**kwargs), param)
    except ValueError as exc:
        raise _bad(param, str(exc)) from None


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad(param, f"expected an object with a 'type', got {value!r}")
    kind, extra = value["type"], set(value) - {"type"}
    if kind in ("text", "json_object") and extra:
        raise _bad(param, f"type {kind!r} takes no other keys, got {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build(param, json_object=True)
    if kind != "json_schema":
        raise _bad(param, f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if extra != {"json_schema"} or not isinstance(spec, dict):
        raise _bad(param, "type 'json_schema' takes {'json_schema': {'name', 'schema', 'strict'?, 'description'?}}")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _bad(param, f"json_schema takes name, schema, strict and description; got {unknown}")
    if "name" in spec and not isinstance(spec["name"], str):
        raise _bad(param, f"json_schema.name must be a string, got {spec['name']!r}")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise _bad(param, f"json_schema.strict must be a bool, got {spec['strict']!r}")
    if not isinstance(spec.get("schema"), dict):
        raise _bad(param, f"json_schema.schema must be a JSON schema (an object), got {spec.get('schema')!r}")
    return _build(param, json_schema=spec["schema"])


def _structured_outputs(value: Any) -> Constraint:
    param = "structured_outputs"
    given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else None
    if given is None or len(given) != 1 or not set(given) <= set(_OUTPUTS):
        raise _bad(param, f"expected an object with exactly one of {', '.join(_OUTPUTS)}, got {value!r}")
    (key, arg), = given.items()  # fmt: skip
    return _build(param, **{_OUTPUTS[key]: arg})


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The constraint of ``response_format``, ``guided_*`` or ``structured_outputs`` (``None``: none given)."""
    found: list[Constraint] = []
    if "response_format" in body:
        rf = _response_format(body["response_format"])
        found += [rf] if rf is not None else []
    if "structured_outputs" in body:
        found.append(_structured_outputs(body["structured_outputs"]))
    for key, kind in _GUIDED.items():
        if key in body:
            found.append(_build(key, **{kind: body[key]}))
    if len(found) > 1:
        raise _bad(found[1].param, f"give one constraint; {found[0].param} was given too")
    return found[0] if found else None


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: as the chat template takes them (``None``: not offered), the plan of the response
    (``None``: no tool calls read) and the constraint of ``"required"`` or a named function."""

    tools: list[dict[str, Any]] | None
    plan: ToolPlan | None
    constraint: Constraint | None


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("tools", "expected a non-empty list of {'type': 'function', 'function': {...}}")
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise _bad(where, f"expected {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
        fn = tool["function"]
        if not isinstance(fn, dict) or set(fn) - _FUNCTION_KEYS:
            extra = sorted(set(fn) - _FUNCTION_KEYS) if isinstance(fn, dict) else fn
            raise _bad(f"{where}.function", f"takes {', '.join(sorted(_FUNCTION_KEYS))}; got {extra!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", f"must be a string, got {fn['description']!r}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters", f"must be a JSON schema (an object), got {fn['parameters']!r}")
    return value


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """``(mode, name)``: mode ``none``, ``auto``, ``required`` or ``named`` (with the function's name)."""
    if value in ("none", "auto", "required"):
        if tools is None and value != "none":
            raise _bad("tool_choice", f"{value!r} needs tools")
        return value, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or set(value) != {"type", "function"}:
        raise _bad("tool_choice", f"expected 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                   f"{{'name': ...}}}}, got {value!r}")  # fmt: skip
    known = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in known:
        raise _bad("tool_choice", f"function {fn['name']!r} is not among the tools ({', '.join(known) or 'none'})")
    return "named", fn["name"]


def parse_tools(body: dict[str, Any], parser: Callable[[], ToolParser]) -> ToolRequest:
    """The tools of a chat body; ``parser`` makes the ``"auto"`` parser (the server's ``--tool-call-parser``)."""
    tools = _tools(body["tools"]) if "tools" in body else None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"expected a bool, got {parallel!r}")
    mode, name = _tool_choice(body.get("tool_choice", "auto" if tools else "none"), tools)
    if mode == "none" or tools is None:
        return ToolRequest(None, None, None)
    if mode == "auto":
        return ToolRequest(tools, ToolPlan("auto", parser=parser(), parallel=parallel), None)
    if mode == "required":
        return ToolRequest(tools, ToolPlan("required", parallel=parallel),
                           _build("tool_choice", json_schema=required_schema(tools, parallel)))  # fmt: skip
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return ToolRequest(tools, ToolPlan("named", name=name), _build("tool_choice", json_schema=parameters_schema(fn)))
