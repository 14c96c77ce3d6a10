"""The FastAPI application of ``llmopt serve``: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models`` (and ``/v1/models/{model}``), plus ``/health`` and ``/metrics``.

Handlers validate the body (:mod:`.protocol`), check the prompt against the engine (token ids, context length),
hand the request to the engine loop (:mod:`.async_engine`) and read its events: as server-sent events in OpenAI's
chunk format ending with ``data: [DONE]`` when ``stream`` is true, else as one JSON body. A client that goes away
cancels its request. Errors are OpenAI's ``{"error": {...}}`` bodies, on every route: 400 for a bad request, 401 for
a missing or wrong API key (``api_key``), 404 for an unknown model or route, 405 for a method a route does not take,
503 with ``Retry-After`` while loading or past ``max_queue``, 500 once the engine's build has failed (or for an
unexpected error). ``/health`` answers a status object instead (``{"status": ...}``), as probes expect.

Text is encoded as everywhere else in the package (:func:`~lightning_llmopt.inference.inputs.encode_prompt`): a
completion's text prompt gets the tokenizer's special tokens (``add_special_tokens`` defaults to true, as in vLLM), a
rendered chat prompt does not (its template writes them; the field defaults to false there, as in vLLM).
"""

# no ``from __future__ import annotations``: FastAPI reads the routes' ``Request`` annotations at runtime
import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

from lightning_llmopt.inference.engine import LLMEngine
from lightning_llmopt.inference.inputs import ContextLengthError, Prompt, encode_prompt
from lightning_llmopt.inference.serving.async_engine import AsyncEngine, QueueFull
from lightning_llmopt.inference.serving.chat import ChatTemplate, find_chat_template, special_strings
from lightning_llmopt.inference.serving.metrics import ServerMetrics
from lightning_llmopt.inference.serving.protocol import APIError, bad_value, parse_chat, parse_completion
from lightning_llmopt.inference.serving.responses import Job, chunks, full_response, running_usage, usage, usage_chunk
from lightning_llmopt.inference.serving.tool_calls import ToolPlan, get_tool_parser
from lightning_llmopt.inference.startup import StartupLog

__all__ = ["Server", "build_app"]


class Server:
    """The state behind the routes: the engine loop, metrics, the served name and the chat template.

    Arguments:
        engine: an :class:`LLMEngine` or a callable building one (on the loop thread, after start-up).
        model_name: the name clients pass as ``model``.
        api_key: when set, ``/v1`` requests need ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait beyond the engine's ``max_num_seqs`` (``None``: no limit).
        chat_template: a template (file or text) overriding the model's.
        model_path: the model folder (where the chat template is looked for).
        grace_s: at shutdown, how long requests in flight may finish before they are cancelled.
        startup: the :class:`~lightning_llmopt.inference.startup.StartupLog` the build records its phases in
            (shown by ``/health`` while loading).
        on_failed: called with the error message if the engine's build fails.
        tool_call_parser: how ``tool_choice="auto"`` reads tool calls in the text (a name of
            :data:`~.tool_calls.TOOL_PARSERS`: ``"hermes"``, ``"llama3_json"``).
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], model_name: str, api_key: str | None = None,
                 max_queue: int | None = None, chat_template: str | None = None,
                 model_path: str | Path | None = None, grace_s: float = 10.0, startup: StartupLog | None = None,
                 on_failed: Callable[[str], None] | None = None, tool_call_parser: str = "hermes") -> None:  # fmt: skip
        get_tool_parser(tool_call_parser)  # a ValueError naming the known parsers, before anything starts
        self.tool_call_parser = tool_call_parser
        self.model_name, self.api_key, self.grace_s = model_name, api_key, grace_s
        self.metrics = ServerMetrics(self._gauge_state)
        self.core = AsyncEngine(engine, max_queue, self.metrics.on_step, startup, on_failed)
        self._template_source, self._model_path = chat_template, model_path
        self._template: ChatTemplate | None | bool = False  # False: not looked up yet

    def _gauge_state(self) -> tuple[LLMEngine | None, int]:
        return self.core.engine, self.core.in_flight

    @property
    def engine(self) -> LLMEngine:
        state = self.core.state
        if state == "failed":
            raise APIError(500, f"the engine failed to load: {self.core.load_error}", code="engine_failed",
                           kind="server_error")  # fmt: skip
        if self.core.engine is None or state != "ready":
            startup = self.core.startup
            phase = f" (phase {startup.current!r})" if state == "loading" and startup and startup.current else ""
            raise APIError(503, f"the model is {state}{phase}; retry later", code="unavailable", kind="server_error",
                           headers={"Retry-After": "5"})  # fmt: skip
        return self.core.engine

    def authorize(self, header: str | None) -> None:
        if self.api_key is None:
            return
        given = header[7:] if header and header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            self.metrics.rejected.labels("unauthorized").inc()
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def template(self, engine: LLMEngine) -> Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]:
        """How messages (and the tools offered, or ``None``) become a prompt: ``--chat-template`` if given, else the
        tokenizer's own ``apply_chat_template`` (:class:`~lightning_llmopt.data.tokenizers.HFTokenizer` renders its
        folder's template as transformers does), else a template found in the model folder; a 400 when there is
        none."""
        tok = engine.tokenizer
        if (
            self._template_source is None
            and getattr(tok, "chat_template", None)
            and hasattr(tok, "apply_chat_template")
        ):
            return lambda msgs, tools: str(tok.apply_chat_template(msgs, add_generation_prompt=True, tools=tools))
        if self._template is False:
            source = find_chat_template(tok, self._model_path, self._template_source)
            self._template = ChatTemplate(source, *special_strings(tok)) if source else None
        if not isinstance(self._template, ChatTemplate):
            raise APIError(400, "this model has no chat template: use /v1/completions, or start the server with "
                           "--chat-template FILE", param="messages", code="no_chat_template")  # fmt: skip
        return self._template.render

    def tokens(self, engine: LLMEngine, prompt: Prompt, params: Any, param: str, add_special_tokens: bool = True,
               truncate_prompt_tokens: int | None = None, constraint_param: str | None = None,
               ) -> list[int]:  # fmt: skip
        """The prompt's ids, checked by the engine (a 400 naming ``param`` if refused, or ``constraint_param`` when
        the engine refuses the structured output only): text encoded with the tokenizer's special tokens when
        ``add_special_tokens``; ``truncate_prompt_tokens`` keeps the last k tokens (``-1``: as many as fit beside
        ``max_tokens``)."""
        keep = truncate_prompt_tokens
        try:
            if keep is not None and keep > 0:
                prompt = encode_prompt(prompt, engine.tokenizer, add_special_tokens)[-keep:]
            return engine.check_request(prompt, params, truncate=keep == -1, add_special_tokens=add_special_tokens)
        except ContextLengthError as exc:
            raise APIError(400, _too_long(exc), param=param, code="context_length_exceeded") from None
        except (ValueError, TypeError) as exc:
            if constraint_param is not None and _refused_constraint(engine, prompt, params, keep, add_special_tokens):
                raise bad_value(constraint_param, str(exc)) from None
            code = "context_length_exceeded" if "max_model_len" in str(exc) or "KV blocks" in str(exc) else None
            raise APIError(400, str(exc), param=param, code=code or "invalid_value") from None

    def submit(self, kind: str, model: str, prompts: list[list[int]], params: Any, logprobs: int | None,
               tools: ToolPlan | None = None) -> Job:  # fmt: skip
        handles = []
        try:
            for tokens in prompts:
                handles.append(self.core.submit(tokens, params))
        except (QueueFull, RuntimeError) as exc:
            for h in handles:
                h.cancel()
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(503, f"server busy: {exc}", code="overloaded", kind="server_error",
                           headers={"Retry-After": "1"}) from None  # fmt: skip
        return Job(kind, model, handles, [len(t) for t in prompts], params.n, logprobs, tools=tools)

    def finish(self, job: Job, end: float | None = None) -> None:
        """Metrics of a finished job, once: latency up to ``end`` (default: now), each choice's finish reason, and
        the tokens of the engine's completions."""
        if job.counted:
            return
        job.counted = True
        end = time.perf_counter() if end is None else end
        for h in job.handles:
            self.metrics.e2e.observe(end - h.submitted)
            if h.completion is not None:
                self.metrics.cached_tokens.inc(h.completion.metrics.cached_tokens)
        for reason in job.final_reasons():
            self.metrics.requests.labels(reason).inc()
        u = usage(job)
        self.metrics.prompt_tokens.inc(u["prompt_tokens"])
        self.metrics.generation_tokens.inc(u["completion_tokens"])

    def abandon(self, job: Job) -> None:
        """Count a job nobody reads to its end (its client went away; its unfinished requests were cancelled): once
        every request has ended, as the engine finished or cancelled it (``finish_reason="abort"``), with the tokens
        generated until then and the latency up to now."""
        end = time.perf_counter()

        def ended() -> None:
            if all(h.ended for h in job.handles):
                self.finish(job, end)

        for h in job.handles:
            h.when_ended(ended)


def _refused_constraint(engine: LLMEngine, prompt: Prompt, params: Any, keep: int | None, special: bool) -> bool:
    """Whether the engine takes the request once its structured output is dropped (then that is what it refused)."""
    try:
        engine.check_request(prompt, dataclasses.replace(params, structured_output=None), keep == -1, special)
    except (ValueError, TypeError):
        return False
    return True


def _too_long(exc: ContextLengthError) -> str:
    """The context-length message with the remedy this API takes (``truncate_prompt_tokens``, not the Python API's
    ``truncate=True``)."""
    if exc.room < 1:
        return f"{exc}; lower max_tokens"
    return (
        f"prompt ({exc.prompt_tokens} tokens) + max_tokens ({exc.max_tokens}) exceeds max_model_len "
        f'({exc.max_model_len}); shorten the prompt, lower max_tokens, or send "truncate_prompt_tokens": '
        f"{exc.room} (or -1) to keep its last {exc.room} tokens"
    )


async def _run(server: Server, job: Job, tokenizer: Any) -> AsyncGenerator[dict[str, Any], None]:
    """The job's chunks as events arrive (records texts for the final body; metrics of first tokens and gaps)."""
    last: dict[int, float] = {}
    offsets: dict[int, int] = {}
    try:
        async for prompt, events in job.events():
            now = time.perf_counter()
            for ev in events:
                index = job.record(prompt, ev)
                if ev.token_ids:
                    if index not in last:
                        server.metrics.ttft.observe(now - job.handles[prompt].submitted)
                    else:
                        server.metrics.itl.observe((now - last[index]) / len(ev.token_ids))
                    last[index] = now
                bodies = chunks(job, tokenizer, index, ev, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(ev.text or "")
                for body in bodies:
                    yield body
        errors = [h.error for h in job.handles if h.error]
        if errors:
            raise APIError(500 if "engine step failed" in errors[0] else 400, errors[0], kind="server_error")
        server.finish(job)
    finally:
        if any(not h.done for h in job.handles):
            job.cancel()  # the client went away (or the stream broke): free its blocks
        if not job.counted and not any(h.error for h in job.handles):
            server.abandon(job)  # counted once the cancels have reached the engine


async def _sse(server: Server, job: Job, tokenizer: Any, include_usage: bool, continuous: bool) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(_run(server, job, tokenizer)) as chunks:
            async for body in chunks:
                if include_usage:
                    body["usage"] = running_usage(job) if continuous else None
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        if include_usage:
            yield f"data: {json.dumps(usage_chunk(job))}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"


async def _collect(server: Server, job: Job, tokenizer: Any, request: Any) -> dict[str, Any]:
    """Run the job to its end, drawing the chunks (which record the text); a client that disconnects meanwhile
    cancels it (checked every 0.25 s, whether or not tokens keep coming)."""
    chunks = _run(server, job, tokenizer)

    async def drain() -> None:
        async for _ in chunks:
            pass

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "client disconnected")
        task.result()
        return full_response(job, tokenizer)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await chunks.aclose()  # cancels what is still running


async def _respond(server: Server, job: Job, req: Any, request: Any) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse

    tokenizer = server.engine.tokenizer
    if req.stream:
        events = _sse(server, job, tokenizer, req.include_usage, req.continuous_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(await _collect(server, job, tokenizer, request))


async def _body(request: Any) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None


def build_app(server: Server) -> Any:
    """The FastAPI app over ``server`` (starts its engine loop at start-up, stops it at shutdown)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.core.start(asyncio.get_running_loop())
        yield
        await server.core.shutdown(server.grace_s)

    app = FastAPI(title="lightning_llmopt", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Any:
        if exc.status == 400:
            server.metrics.rejected.labels("invalid").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    _framework_errors(app)

    @app.get("/health")
    async def health() -> Any:
        state = server.core.state
        body: dict[str, Any] = {"status": "ok" if state == "ready" else state}
        if server.core.load_error:
            body["error"] = server.core.load_error
        if state in ("loading", "failed") and server.core.startup is not None:
            body["startup"] = server.core.startup.summary()
        return JSONResponse(body, status_code={"ready": 200, "failed": 500}.get(state, 503))

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _generation_routes(app, server)
    return app


def _framework_errors(app: Any) -> None:
    """The web framework's own errors (no such route, a method the route does not take, an unexpected exception)
    as OpenAI error bodies instead of ``{"detail": ...}`` or plain text."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            error = APIError(404, f"no route {where}; the API is under /v1 (completions, chat/completions, models)",
                             code="not_found")  # fmt: skip
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            error = APIError(405, f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})",
                             code="method_not_allowed")  # fmt: skip
        else:
            error = APIError(exc.status_code, f"{where}: {exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Any:  # the server logs the traceback
        error = APIError(500, f"internal server error ({type(exc).__name__}) in {request.method} {request.url.path}",
                         code="internal_error", kind="server_error")  # fmt: skip
        return JSONResponse(error.body(), status_code=500)


def _generation_routes(app: Any, server: Server) -> None:
    """The ``/v1`` routes."""
    from fastapi import Request

    def card(request: Request) -> dict[str, Any]:
        server.authorize(request.headers.get("authorization"))
        found = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "lightning_llmopt"}
        if server.core.engine is not None:
            found["max_model_len"] = server.core.engine.max_model_len
        return found

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        return {"object": "list", "data": [card(request)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Any:
        found = card(request)
        server.check_model(model)
        return found

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        server.authorize(request.headers.get("authorization"))
        req = parse_completion(await _body(request))
        server.check_model(req.model)
        engine = server.engine
        prompts = [
            server.tokens(engine, p, req.params, "prompt", req.add_special_tokens, req.truncate_prompt_tokens,
                          req.constraint_param)  # fmt: skip
            for p in req.prompts
        ]
        job = server.submit("completion", req.model, prompts, req.params, req.logprobs)
        return await _respond(server, job, req, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        server.authorize(request.headers.get("authorization"))
        engine = server.engine
        req = parse_chat(await _body(request), 1, lambda: get_tool_parser(server.tool_call_parser))
        server.check_model(req.model)
        render = server.template(engine)
        try:
            text = render(req.messages, req.tools)
        except Exception as exc:  # noqa: BLE001 - the template refused the messages (roles, content)
            raise APIError(400, f"chat template: {exc}", param="messages") from None
        params, encoding = req.params, (req.add_special_tokens, req.truncate_prompt_tokens, req.constraint_param)
        tokens = server.tokens(engine, text, params, "messages", *encoding)
        if not req.max_tokens_given:  # the answer may fill the context
            params = dataclasses.replace(params, max_tokens=max(engine.max_model_len - len(tokens), 1))
            tokens = server.tokens(engine, tokens, params, "messages", constraint_param=req.constraint_param)
        job = server.submit("chat", req.model, [tokens], params, req.logprobs, req.tool_plan)
        return await _respond(server, job, req, request)
