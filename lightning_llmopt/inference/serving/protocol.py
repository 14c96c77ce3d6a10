"""The OpenAI request bodies we accept, turned into :class:`SamplingParams`; errors in OpenAI's shape.

Every key of a body is either supported (:data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS`) or refused with a 400
naming it: nothing is silently ignored. A key sent as ``null`` counts as absent. ``user`` is accepted as metadata
(it changes nothing, as with OpenAI). Extensions beyond OpenAI's fields, as vLLM names them: ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``add_special_tokens`` (whether text is encoded with the
tokenizer's special tokens: true for completions, as transformers and ``llmopt generate`` encode text; false for
chat, whose template writes them), ``truncate_prompt_tokens`` (keep the prompt's last k tokens; -1: as many as fit
beside ``max_tokens``) and ``skip_special_tokens`` (leave the tokenizer's special tokens out of the text: true by
default, as in vLLM); ``stop`` also takes token ids. ``response_format``, vLLM's ``guided_*``/``structured_outputs``
and chat's ``tools``/``tool_choice``/``parallel_tool_calls`` are read by :mod:`.structured`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_llmopt.inference.sampling_params import MAX_LOGPROBS, SamplingParams
from lightning_llmopt.inference.serving.structured import (
    CONSTRAINT_FIELDS,
    TOOL_FIELDS,
    Constraint,
    FieldError,
    parse_constraint,
    parse_tools,
)
from lightning_llmopt.inference.serving.tool_calls import Hermes, ToolParser, ToolPlan
from lightning_llmopt.inference.structured_output import StructuredOutput

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "bad_value", "parse_chat", "parse_completion"]

_SAMPLING = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options", "user", "ignore_eos",
    "add_special_tokens", "truncate_prompt_tokens", "skip_special_tokens",
}  # fmt: skip
COMPLETION_FIELDS = frozenset(_SAMPLING | CONSTRAINT_FIELDS | {"prompt", "logprobs"})
CHAT_FIELDS = frozenset(
    _SAMPLING | CONSTRAINT_FIELDS | TOOL_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
)
MAX_N = 16


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_value(param: str, message: str) -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


_bad = bad_value


@dataclass
class CompletionRequest:
    """A parsed ``/v1/completions`` body: the prompts (text or token ids), their parameters and the options."""

    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: as many as fit
    constraint_param: str | None = None  # the field whose constraint is in params (named if the engine refuses it)


@dataclass
class ChatRequest:
    """A parsed ``/v1/chat/completions`` body."""

    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # top_logprobs when ``logprobs`` is true
    max_tokens_given: bool
    add_special_tokens: bool = False  # the template writes the BOS
    truncate_prompt_tokens: int | None = None
    constraint_param: str | None = None
    tools: list[dict[str, Any]] | None = None  # as the chat template takes them; None: not offered
    tool_plan: ToolPlan | None = None  # how the output becomes tool calls; None: plain content


def _check_keys(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    given = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise APIError(
            400,
            f"unsupported parameter(s): {', '.join(unknown)}; supported: {', '.join(sorted(allowed))}",
            param=unknown[0],
            code="unsupported_parameter",
        )
    if not isinstance(given.get("model"), str) or not given["model"]:
        raise _bad("model", "a model name (string) is required")
    return given


def _typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _bad(key, f"expected {names}, got {type(value).__name__} {value!r}")
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)``; the second (vLLM's extension) puts the usage so far in every
    chunk, which tells a client how many tokens each chunk carries."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise _bad("stream_options", "supported: {'include_usage': bool, 'continuous_usage_stats': bool}")
    usage = bool(_typed(opts, "include_usage", (bool,), False))
    return usage, usage and bool(_typed(opts, "continuous_usage_stats", (bool,), False))


def _stops(body: dict[str, Any]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(stop, list) or any(isinstance(s, bool) or not isinstance(s, (str, int)) for s in stop):
        raise _bad("stop", "expected a string, a token id or a list of them")
    ids = _typed(body, "stop_token_ids", (list,), [])
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise _bad("stop_token_ids", "expected a list of token ids")
    strings = tuple(s for s in stop if isinstance(s, str))
    return strings, tuple(t for t in stop if isinstance(t, int)) + tuple(ids)


def _params(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
            structured: StructuredOutput | None = None) -> SamplingParams:  # fmt: skip
    num = (int, float)
    stop, stop_ids = _stops(body)
    if max_tokens is not None and not isinstance(max_tokens, bool) and isinstance(max_tokens, int) and max_tokens < 1:
        raise _bad("max_tokens", f"must be >= 1, got {max_tokens}")
    n = _typed(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"must be in [1, {MAX_N}], got {n}")
    temperature = _typed(body, "temperature", num, 1.0)
    top_k = _typed(body, "top_k", (int,), None)
    kwargs = dict(
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=temperature,
        top_k=None if top_k is None or top_k < 0 else top_k,  # -1: off, as in vLLM
        top_p=_typed(body, "top_p", num, 1.0),
        min_p=_typed(body, "min_p", num, 0.0),
        seed=_typed(body, "seed", (int,), None),
        n=n,
        presence_penalty=_typed(body, "presence_penalty", num, 0.0),
        frequency_penalty=_typed(body, "frequency_penalty", num, 0.0),
        repetition_penalty=_typed(body, "repetition_penalty", num, 1.0),
        ignore_eos=_typed(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        stop=stop,
        stop_token_ids=stop_ids,
        skip_special_tokens=_typed(body, "skip_special_tokens", (bool,), True),
        structured_output=structured,
    )
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        param = next((k for k in kwargs if str(exc).startswith(k)), None)
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def _encoding(body: dict[str, Any], special_default: bool) -> tuple[bool, int | None]:
    """``(add_special_tokens, truncate_prompt_tokens)`` as vLLM reads them."""
    special = bool(_typed(body, "add_special_tokens", (bool,), special_default))
    keep = _typed(body, "truncate_prompt_tokens", (int,), None)
    if keep is not None and keep < 1 and keep != -1:
        raise _bad("truncate_prompt_tokens", f"must be >= 1 (prompt tokens to keep) or -1 (as many as fit), got {keep}")
    return special, keep


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise _bad("prompt", "expected a non-empty string, list of strings, token ids or list of token-id lists")


def _constraint(body: dict[str, Any]) -> Constraint | None:
    try:
        return parse_constraint(body)
    except FieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (raises :class:`APIError` naming the offending field)."""
    body = _check_keys(body, COMPLETION_FIELDS)
    logprobs = _typed(body, "logprobs", (int,), None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise _bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    max_tokens = _typed(body, "max_tokens", (int,), 16)
    stream = _typed(body, "stream", (bool,), False)
    constraint = _constraint(body)
    params = _params(body, max_tokens, logprobs, constraint.output if constraint else None)
    return CompletionRequest(
        body["model"], _prompts(body), params, stream, *_stream_options(body, stream), logprobs,
        *_encoding(body, True), constraint.param if constraint else None,
    )  # fmt: skip


def _text(i: int, content: Any, nullable: bool) -> str:
    if content is None and nullable:
        return ""
    if isinstance(content, list):  # content parts: text only
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):  # fmt: skip
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
    return content


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as Hugging Face templates read them: ``function.arguments`` holding a
    JSON object is passed as a dict."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(where, f"expected a list of tool calls, got {calls!r}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        kind = call.get("type", "function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or kind != "function":
            raise _bad(f"{where}[{j}]", "expected {id, type: 'function', function: {name, arguments}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif not isinstance(args, dict):
            raise _bad(f"{where}[{j}].function.arguments", f"expected JSON text or an object, got {args!r}")
        out.append({**{k: call[k] for k in ("id",) if k in call}, "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})  # fmt: skip
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        keys = {"role", "content", "name", "tool_calls", "tool_call_id"}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - keys:
            raise _bad(f"messages[{i}]", "expected {role: str, content: str} (name, tool_calls, tool_call_id optional)")
        calls = m.get("tool_calls")
        if calls is not None and m["role"] != "assistant":
            raise _bad(f"messages[{i}].tool_calls", f"only assistant messages hold tool calls, not {m['role']!r}")
        message: dict[str, Any] = {"role": m["role"], "content": _text(i, m.get("content"), calls is not None)}
        if m.get("name") is not None:
            message["name"] = m["name"]
        if calls is not None:
            message["tool_calls"] = _tool_calls(i, calls)
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise _bad(f"messages[{i}].tool_call_id", f"expected a string, got {m['tool_call_id']!r}")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def parse_chat(body: Any, default_max_tokens: int, tool_parser: Callable[[], ToolParser] = Hermes) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; without ``max_tokens`` the answer may fill the context (the
    caller lowers ``default_max_tokens`` to the room the prompt leaves). ``tool_parser`` makes the parser of
    ``tool_choice="auto"``."""
    body = _check_keys(body, CHAT_FIELDS)
    want = _typed(body, "logprobs", (bool,), False)
    top = _typed(body, "top_logprobs", (int,), None)
    if top is not None and not want:
        raise _bad("top_logprobs", "needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _bad("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    logprobs = (top or 0) if want else None
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise _bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _typed(body, key, (int,), None)
    stream = _typed(body, "stream", (bool,), False)
    messages = _messages(body)
    constraint = _constraint(body)
    try:
        tools = parse_tools(body, tool_parser)
    except FieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if tools.constraint is not None and constraint is not None:
        raise _bad("tool_choice", f"a required or named tool choice cannot be combined with {constraint.param}")
    constraint = constraint or tools.constraint
    structured = constraint.output if constraint else None
    params = _params(body, max_tokens if max_tokens is not None else default_max_tokens, logprobs, structured)
    usage, continuous = _stream_options(body, stream)
    return ChatRequest(
        body["model"], messages, params, stream, usage, continuous, logprobs, max_tokens is not None,
        *_encoding(body, False), constraint.param if constraint else None, tools.tools, tools.plan,
    )  # fmt: skip
