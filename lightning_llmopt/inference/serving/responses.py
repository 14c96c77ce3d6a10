"""OpenAI response bodies: whole completions, stream chunks, log-probabilities and usage.

A :class:`Job` is one HTTP request: one engine request per prompt (``/v1/completions`` takes a list), each with
``n`` choices; choice ``index`` is ``prompt * n + i`` as in OpenAI's API. A chat job with a
:class:`~.tool_calls.ToolPlan` reads each choice's text for tool calls (:class:`~.tool_calls.ToolStream` when
streamed), choice by choice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lightning_llmopt.inference.request import StreamEvent
from lightning_llmopt.inference.sampling import TokenLogprobs
from lightning_llmopt.inference.serving.async_engine import Handle
from lightning_llmopt.inference.serving.tool_calls import ToolPlan, ToolStream

__all__ = ["Job", "chunks", "format_logprobs", "full_response", "running_usage", "usage", "usage_chunk"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort"}


@dataclass
class Job:
    """One HTTP request's engine requests and what was streamed of each choice."""

    kind: str  # "completion" or "chat"
    model: str
    handles: list[Handle]
    prompt_tokens: list[int]
    n: int
    logprobs: int | None
    id: str = ""  # OpenAI's shape: chatcmpl-... for chat, cmpl-... for completions
    created: int = field(default_factory=lambda: int(time.time()))
    texts: dict[int, list[str]] = field(default_factory=dict)
    lps: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)  # chat choices whose role chunk was sent
    generated: int = 0  # tokens streamed so far, all choices
    counted: bool = False  # in the server's metrics already
    tools: ToolPlan | None = None  # chat: how each choice's text becomes tool calls
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    async def events(self) -> AsyncIterator[tuple[int, list[StreamEvent]]]:
        """``(prompt index, events)`` as they come, from every handle; ends when all are done."""
        merged: asyncio.Queue[tuple[int, list[StreamEvent] | None]] = asyncio.Queue()

        async def pump(i: int, h: Handle) -> None:
            while (item := await h.queue.get()) is not None:
                merged.put_nowait((i, item))
            merged.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            left = len(tasks)
            while left:
                i, item = await merged.get()
                if item is None:
                    left -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def final_reasons(self) -> list[str]:
        """Every choice's finish reason: as streamed, else the engine's (a job whose client went away is not read
        to its end), else ``"abort"`` (cancelled before the engine reported it)."""
        reasons = []
        for prompt, h in enumerate(self.handles):
            outputs = {o.index: o for o in h.completion.outputs} if h.completion is not None else {}
            for i in range(self.n):
                out = outputs.get(i)
                engine = _FINISH.get(out.finish_reason or "", out.finish_reason) if out is not None else None
                reasons.append(self.reasons.get(prompt * self.n + i) or engine or "abort")
        return reasons

    def record(self, prompt: int, ev: StreamEvent) -> int:
        """Remember an event's text, logprobs and finish reason; returns its choice index."""
        index = prompt * self.n + ev.index
        self.generated += len(ev.token_ids)
        self.texts.setdefault(index, []).append(ev.text or "")
        self.lps.setdefault(index, []).extend(ev.logprobs or [])
        if ev.finished:
            self.reasons[index] = _FINISH.get(ev.finish_reason or "", ev.finish_reason)
        return index


def usage(job: Job) -> dict[str, int]:
    completion = sum(len(o.token_ids) for h in job.handles if h.completion is not None for o in h.completion.outputs)
    prompt = sum(job.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _piece(tokenizer: Any, token: int) -> str:
    try:
        return str(tokenizer.decode([token])) if tokenizer is not None else str(token)
    except Exception:  # noqa: BLE001 - an id the tokenizer does not know (padded vocabulary)
        return ""


_TABLES: dict[int, tuple[Any, list[bytes]]] = {}  # id(tokenizer) -> (tokenizer, each id's bytes)


def _token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes a token writes: from the tokenizer's ``token_bytes()`` table when it has one, else its text."""
    table = getattr(tokenizer, "token_bytes", None)
    if not callable(table):
        return _piece(tokenizer, token).encode()
    cached = _TABLES.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        cached = _TABLES[id(tokenizer)] = (tokenizer, table())
    return cached[1][token] if 0 <= token < len(cached[1]) else b""


def _token(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """A token as OpenAI names it, and its bytes: its text when its bytes are whole UTF-8, else ``bytes:\\xNN...``
    (so that tokens holding different parts of a character get different names)."""
    raw = _token_bytes(tokenizer, token) if tokenizer is not None else str(token).encode()
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def format_logprobs(kind: str, tokenizer: Any, lps: list[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object of a choice: the legacy per-token lists for completions (``text_offset`` from
    ``offset``), ``{"content": [...]}`` for chat. Tokens are named by :func:`_token`."""
    if kind == "chat":
        content = []
        for lp in lps:
            tok, raw = _token(tokenizer, lp.token)
            top = [{"token": (n := _token(tokenizer, t))[0], "logprob": v, "bytes": n[1]} for t, v in lp.top]
            content.append({"token": tok, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}
    tokens = [_token(tokenizer, lp.token)[0] for lp in lps]
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(_piece(tokenizer, lp.token))
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token(tokenizer, t)[0]: v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_deltas(job: Job, index: int, ev: StreamEvent, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The deltas of one chat event and the finish reason (tool calls read from the text when the job has tools)."""
    if job.tools is None:
        return ([] if ev.finished and not ev.text else [{"content": ev.text or ""}]), reason
    stream = job.tool_streams.setdefault(index, ToolStream(job.tools))
    deltas = stream.feed(ev.text or "")
    if ev.finished:
        held, reason = stream.finish(reason)
        deltas += held
    return deltas, reason


def chunks(job: Job, tokenizer: Any, index: int, ev: StreamEvent, offset: int) -> list[dict[str, Any]]:
    """The stream chunks of one event of choice ``index`` (none when it carries nothing to send); the finish reason
    is in the last."""
    lps = (
        format_logprobs(job.kind, tokenizer, ev.logprobs, offset) if job.logprobs is not None and ev.logprobs else None
    )
    reason = _FINISH.get(ev.finish_reason or "", ev.finish_reason) if ev.finished else None
    if not ev.token_ids and not ev.finished and (job.kind != "chat" or index in job.started):
        return []  # (new tokens always make a chunk, even when their text is held back: clients time tokens)
    head = {"id": job.id, "created": job.created, "model": job.model}
    if job.kind != "chat":
        choice = {"index": index, "text": ev.text or "", "logprobs": lps, "finish_reason": reason}
        return [{**head, "object": "text_completion", "choices": [choice]}]
    deltas, reason = _chat_deltas(job, index, ev, reason)
    deltas = deltas or [{}]
    if index not in job.started:
        job.started.add(index)
        deltas[0] = {"role": "assistant", **deltas[0]}
    out = []
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        choice = {"index": index, "delta": delta, "logprobs": lps if k == 0 else None,
                  "finish_reason": reason if last else None}  # fmt: skip
        out.append({**head, "object": "chat.completion.chunk", "choices": [choice]})
    return out


def running_usage(job: Job) -> dict[str, int]:
    """The usage so far (``continuous_usage_stats``)."""
    prompt = sum(job.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": job.generated, "total_tokens": prompt + job.generated}


def usage_chunk(job: Job) -> dict[str, Any]:
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [],
            "usage": usage(job)}  # fmt: skip


def full_response(job: Job, tokenizer: Any) -> dict[str, Any]:
    """The whole (non-streamed) response body."""
    choices = []
    for index in sorted(job.texts):
        text = "".join(job.texts[index])
        lps = format_logprobs(job.kind, tokenizer, job.lps[index]) if job.logprobs is not None else None
        reason = job.reasons.get(index)
        if job.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if job.tools is not None:
                parsed = job.tools.parse(text)
                reason = job.tools.finish_reason(parsed, reason)
                if parsed.calls:
                    message = {**message, "content": parsed.content, "tool_calls": [c.to_dict() for c in parsed.calls]}
            choices.append({"index": index, "message": message, "logprobs": lps, "finish_reason": reason})
        else:
            choices.append({"index": index, "text": text, "logprobs": lps, "finish_reason": reason})
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": choices,
            "usage": usage(job)}  # fmt: skip
