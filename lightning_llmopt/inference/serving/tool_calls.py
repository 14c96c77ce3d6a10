"""Tool calls in generated text: the parsers of ``tool_choice="auto"`` (one per model family's format, picked with
``--tool-call-parser``), the constraint of ``"required"`` and of a named function, and the streaming of each.

Formats read by the parsers (:data:`TOOL_PARSERS`):

- ``hermes`` (Hermes 2/3, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  after optional text; the text before the first is the message's content. An unclosed last block counts (a model
  may end at its end-of-sequence token instead of writing the closing tag).
- ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the whole output is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` also read), or several separated by ``;``, optionally after ``<|python_tag|>``.

Text that does not parse in full stays the message's content, and no tool call is reported.

``"required"`` constrains the output to a JSON array of ``{"name": <a tool's name>, "parameters": <its arguments>}``
(one ``anyOf`` branch per tool, so that each name goes with its own schema); a named function constrains it to that
function's parameters, and the whole text is the call's arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "TOOL_PARSERS",
    "Hermes",
    "Llama3Json",
    "Parsed",
    "ToolCall",
    "ToolParser",
    "ToolPlan",
    "ToolStream",
    "get_tool_parser",
    "required_schema",
]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI sends them as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """What a parser read: the content (``None`` when only tool calls were written) and the calls."""

    content: str | None
    calls: list[ToolCall]


class ToolParser(Protocol):
    """Reads tool calls in one model family's format."""

    def parse(self, text: str) -> Parsed:
        """The content and tool calls of a whole output; ``Parsed(text, [])`` unless the calls parse in full."""
        ...

    def releasable(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows (streamed at once)."""
        ...


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text: an object is written out, a string is taken if it holds a JSON object."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except ValueError:
            return None
    return None


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from ``{"name": str, <one of keys>: object}`` (arguments absent: ``{}``), else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    args = "{}" if key is None else _arguments(obj[key])
    return None if args is None else ToolCall(obj["name"], args)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Hermes:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring)."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text, [])
        calls = []
        for block in text[first:].split(self.start)[1:]:
            body = block.split(self.end, 1)[0].strip()
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        return Parsed(text[:first].rstrip() or None, calls)

    def releasable(self, text: str) -> int:
        found = text.find(self.start)
        end = found if found >= 0 else len(text) - _held_prefix(text, self.start)
        return len(text[:end].rstrip())


class Llama3Json:
    """The whole output is one JSON call, or several separated by ``;`` (see the module docstring)."""

    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        body = body[len(self.tag) :].lstrip() if body.startswith(self.tag) else body
        if not body.startswith("{"):
            return Parsed(text, [])
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return Parsed(text, [])
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest and not rest.startswith(";"):
                return Parsed(text, [])
            pos = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return Parsed(None, calls)

    def releasable(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.tag.startswith(body[: len(self.tag)]):
            return 0  # may still be a call: hold it all
        return len(text)


TOOL_PARSERS: dict[str, type] = {"hermes": Hermes, "llama3_json": Llama3Json}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (``ValueError`` naming the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is unknown; known: {', '.join(sorted(TOOL_PARSERS))}")
    parser: ToolParser = TOOL_PARSERS[name]()
    return parser


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice="required"``: an array of at least one ``{"name", "parameters"}``, each
    name with its own tool's parameter schema (at most one item when ``parallel`` is false)."""
    branches = []
    for tool in tools:
        fn = tool["function"]
        branches.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": parameters_schema(fn)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema (no ``parameters``: an object without properties)."""
    params = function.get("parameters")
    return params if params is not None else {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls.

    Arguments:
        mode: ``"auto"`` (a parser reads the text), ``"required"`` (the text is :func:`required_schema`'s array) or
            ``"named"`` (the text is the arguments of ``name``).
        parser: the parser of ``"auto"``.
        name: the function of ``"named"``.
        parallel: ``parallel_tool_calls``; when false, ``"auto"`` keeps the first call only.
    """

    mode: str
    parser: ToolParser | None = None
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required", "named"):
            raise ValueError(f"mode ({self.mode!r}) must be 'auto', 'required' or 'named'")
        if (self.mode == "auto") != (self.parser is not None) or (self.mode == "named") != (self.name is not None):
            raise ValueError(f"mode {self.mode!r} takes a parser for 'auto' and a name for 'named' only")

    def parse(self, text: str) -> Parsed:
        """The content and calls of a whole output."""
        if self.mode == "named":
            return Parsed(None, [ToolCall(str(self.name), text)])
        if self.mode == "required":
            return _parse_required(text)
        assert self.parser is not None
        parsed = self.parser.parse(text)
        return parsed if self.parallel or len(parsed.calls) < 2 else Parsed(parsed.content, parsed.calls[:1])

    def finish_reason(self, parsed: Parsed, engine_reason: str | None) -> str | None:
        """``"tool_calls"`` when calls were read (``"auto"``, ``"required"``) and the output ended by itself;
        a named function keeps the engine's reason, as vLLM does."""
        if parsed.calls and self.mode != "named" and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def _parse_required(text: str) -> Parsed:
    try:
        items = json.loads(text)
    except ValueError:
        return Parsed(text, [])
    calls = [_call(item, ("parameters",)) for item in items] if isinstance(items, list) else [None]
    if not calls or any(c is None for c in calls):
        return Parsed(text, [])
    return Parsed(None, [c for c in calls if c is not None])


class ToolStream:
    """The deltas of one streamed choice: content as soon as it is surely content, tool calls in OpenAI's chunk
    shape (``index``, ``id``, ``type``, the function's name with ``arguments: ""``, then the arguments).

    A named function streams its arguments as they come; ``"required"`` holds the text until the end; ``"auto"``
    streams content up to where its parser's format may begin, and holds the rest until the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0
        self.named_id = _call_id() if plan.mode == "named" else None

    def _named_delta(self, piece: str, first: bool) -> dict[str, Any]:
        if first:
            fn = {"name": self.plan.name, "arguments": piece}
            return {"tool_calls": [{"index": 0, "id": self.named_id, "type": "function", "function": fn}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas ``piece`` (new text) releases."""
        first = not self.text
        self.text += piece
        if self.plan.mode == "named":
            return [self._named_delta(piece, first)] if piece else []
        if self.plan.mode == "required":
            return []
        assert self.plan.parser is not None
        upto = self.plan.parser.releasable(self.text)
        if upto <= self.sent:
            return []
        out, self.sent = self.text[self.sent : upto], upto
        return [{"content": out}]

    def finish(self, engine_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held until the end, and the choice's finish reason."""
        if self.plan.mode == "named":
            return ([self._named_delta("", True)] if not self.text else []), engine_reason
        parsed = self.plan.parse(self.text)
        content = parsed.content or ""
        deltas: list[dict[str, Any]] = [{"content": content[self.sent :]}] if len(content) > self.sent else []
        for i, call in enumerate(parsed.calls):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas, self.plan.finish_reason(parsed, engine_reason)
