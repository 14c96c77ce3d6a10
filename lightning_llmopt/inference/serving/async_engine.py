"""One engine loop for every HTTP request: :class:`AsyncEngine`.

The :class:`~lightning_llmopt.inference.LLMEngine` is not thread-safe, so exactly one thread touches it: the loop
thread. It builds the engine (``/health`` says ``"loading"`` until then, with the phases done so far; ``"failed"``
with the error if the build raised), then repeats: take the commands the HTTP handlers queued (add a request, cancel
one), run one :meth:`LLMEngine.step`, and hand each request's events to its :class:`Handle` on the event loop
(``call_soon_threadsafe``). Handlers only enqueue commands and read their handle.

- Optionally, delivery waits for the next step's launch: with ``delivery_delay`` a step's events reach the event
  loop that many seconds after the step returns when another step follows (``None``: the engine thread's CPU time
  of a step, averaged, at most a quarter of a step), so that the handlers' burst of work (a chunk per request)
  overlaps the next step's device time instead of competing for the GIL with its host work. Off by default: on
  CPU (``benchmarks/profile_serve_load.py``, 64 streams, 20 ms steps) one run with 3 ms gave HTTP/offline 0.92
  against 0.87, one adaptive run 0.80; not yet measured on a GPU. Items keep their order; a request's end, a
  cancel or an error is never delivered before the events queued ahead of it.
- A handle that is closed before its request finished (the client went away) cancels the request: its blocks go
  back to the pool at the loop's next turn.
- Back-pressure: past ``max_num_seqs + max_queue`` requests in flight, :meth:`AsyncEngine.submit` raises
  :class:`QueueFull` (the server answers 503 with ``Retry-After``).
- :meth:`AsyncEngine.shutdown` refuses new requests, lets those in flight finish for ``grace_s`` seconds, cancels
  the rest (their streams end with ``finish_reason="abort"``) and stops the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_llmopt.inference.engine import LLMEngine
from lightning_llmopt.inference.request import Completion, StreamEvent
from lightning_llmopt.inference.sampling import SamplingParams
from lightning_llmopt.inference.startup import StartupLog

__all__ = ["AsyncEngine", "Handle", "QueueFull"]

log = logging.getLogger("lightning_llmopt.serve")


class QueueFull(RuntimeError):
    """More requests are in flight than the server accepts (``max_num_seqs + max_queue``)."""


@dataclass
class Handle:
    """What a handler reads: ``events`` (lists of :class:`StreamEvent` s), then ``None`` once the request is done;
    ``completion`` (with its metrics) is set by then; ``error`` if the engine failed it. ``ended`` turns true on the
    event loop when that ``None`` is queued, whether or not anyone reads it (:meth:`when_ended`)."""

    request_id: str
    n: int
    queue: asyncio.Queue[list[StreamEvent] | None]
    engine: AsyncEngine
    submitted: float = field(default_factory=time.perf_counter)
    completion: Completion | None = None
    error: str | None = None
    done: bool = False
    finished: set[int] = field(default_factory=set)
    ended: bool = False
    _on_end: list[Callable[[], None]] = field(default_factory=list)

    def cancel(self) -> None:
        """Cancel the request if it has not finished (the client went away)."""
        if not self.done:
            self.engine._command(("cancel", self.request_id))

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the event loop once the request has ended (now if it has)."""
        if self.ended:
            callback()
        else:
            self._on_end.append(callback)


class AsyncEngine:
    """The loop thread around an :class:`LLMEngine` (see the module docstring).

    Arguments:
        build: the engine, or a callable building it (run on the loop thread: ``/health`` is ``"loading"``).
        max_queue: requests that may wait for a slot beyond the engine's ``max_num_seqs`` running ones
            (``None``: no limit).
        on_step: called on the loop thread after every step with ``(engine, events, seconds)`` (metrics).
        startup: the :class:`~lightning_llmopt.inference.startup.StartupLog` the build records its phases in
            (``/health`` shows them while loading); default: the built engine's own.
        on_failed: called on the loop thread with the error message when the build fails (``llmopt serve`` then
            stops the server and exits non-zero).
        delivery_delay: seconds a step's events wait before the event loop gets them while another step follows
            (``None``: adaptive, see the module docstring; ``0``, the default: at once).
    """

    def __init__(
        self,
        build: LLMEngine | Callable[[], LLMEngine],
        max_queue: int | None = None,
        on_step: Callable[[LLMEngine, list[StreamEvent], float], None] | None = None,
        startup: StartupLog | None = None,
        on_failed: Callable[[str], None] | None = None,
        delivery_delay: float | None = 0.0,
    ) -> None:
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue ({max_queue}) must be >= 0")
        if delivery_delay is not None and delivery_delay < 0:
            raise ValueError(f"delivery_delay ({delivery_delay}) must be >= 0 (or None: adaptive)")
        self.delivery_delay = delivery_delay
        self._build = build
        self.max_queue = max_queue
        self.on_step = on_step
        self.engine: LLMEngine | None = build if isinstance(build, LLMEngine) else None
        self.startup = startup if startup is not None else getattr(self.engine, "startup", None)
        self.on_failed = on_failed
        self.state = "loading"
        self.load_error: str | None = None
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host_s = 0.0  # engine thread CPU time per step (moving average)
        self._wall_s = 0.0  # step wall time (moving average)
        self._pending: list[list[tuple[Handle, list[StreamEvent] | None]]] = []  # on the event loop: held back
        self._flush_at: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop thread; events are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def capacity(self) -> int | None:
        if self.max_queue is None or self.engine is None:
            return None
        return self.engine.config.max_num_seqs + self.max_queue

    def submit(self, tokens: list[int], params: SamplingParams) -> Handle:
        """Queue a validated request (token ids); raises :class:`QueueFull` past the limit."""
        if self._stopping or self.engine is None or self._loop is None:
            raise RuntimeError("the engine is not serving (loading or shutting down)")
        cap = self.capacity()
        if cap is not None and self.in_flight >= cap:
            raise QueueFull(f"{self.in_flight} requests in flight (limit {cap})")
        rid = f"cmpl-{next(self._ids)}"
        handle = Handle(rid, params.n, asyncio.Queue(), self)
        self._handles[rid] = handle
        self._command(("add", (rid, tokens, params)))
        return handle

    def _command(self, cmd: tuple[str, Any]) -> None:
        self._commands.append(cmd)
        self._wake.set()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new requests, let those in flight finish for ``grace_s`` seconds, cancel the rest, stop."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._handles and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.02)
        for rid in list(self._handles):
            self._command(("cancel", rid))
        while self._handles and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # ------------------------------------------------------------------ loop thread
    def _deliver(self, handle: Handle, item: list[StreamEvent] | None) -> None:
        self._deliver_all([(handle, item)])

    def _deliver_all(self, items: list[tuple[Handle, list[StreamEvent] | None]], delay: float = 0.0) -> None:
        """Hand items to their handles' queues on the event loop, with one wake-up of the loop for all of them,
        ``delay`` seconds from now (after what is held back already, in order)."""
        assert self._loop is not None
        for handle, item in items:
            if item is None:
                handle.done = True
                self._handles.pop(handle.request_id, None)
        try:
            self._loop.call_soon_threadsafe(self._arrive, items, delay)
        except RuntimeError:  # the event loop is closed: nobody reads any more
            pass

    def _arrive(self, items: list[tuple[Handle, list[StreamEvent] | None]], delay: float) -> None:
        """On the event loop: deliver now, or hold back until ``delay`` has passed (or the held items' timer)."""
        self._pending.append(items)
        if self._flush_at is not None:
            return
        if delay > 0:
            self._flush_at = asyncio.get_running_loop().call_later(delay, self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        self._flush_at = None
        pending, self._pending = self._pending, []
        for items in pending:
            _put_all(items)

    def _next_delay(self) -> float:
        if self.delivery_delay is not None:
            return self.delivery_delay
        return min(self._host_s, 0.25 * self._wall_s)

    def _run(self) -> None:
        if self.engine is None:
            try:
                assert not isinstance(self._build, LLMEngine)
                engine = self._build()
            except Exception as exc:  # noqa: BLE001 - reported by /health
                phase = self.startup.current if self.startup is not None else None
                where = f" (in phase {phase!r})" if phase else ""
                self.state, self.load_error = "failed", f"{type(exc).__name__}: {exc}{where}"
                log.debug("building the engine failed%s", where, exc_info=True)
                if self.on_failed is not None:
                    self.on_failed(self.load_error)
                else:  # nobody else reports it: one line (the traceback at DEBUG)
                    log.error("building the engine failed: %s", self.load_error)
                return
            if self.startup is None:
                self.startup = getattr(engine, "startup", None)
            self.engine = engine
        self.state = "ready"
        engine = self.engine
        while not self._stop:
            self._drain(engine)
            if not engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                events = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                self._fail_all(engine, f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            wall = time.perf_counter() - start
            self._host_s += 0.1 * (time.thread_time() - cpu - self._host_s)
            self._wall_s += 0.1 * (wall - self._wall_s)
            if self.on_step is not None:
                self.on_step(engine, events, wall)
            self._dispatch(engine, events)
        self.state = "stopped"

    def _drain(self, engine: LLMEngine) -> None:
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add":
                rid, tokens, params = arg
                handle = self._handles.get(rid)
                if handle is None:
                    continue
                try:
                    engine.add_request(tokens, params, request_id=rid)
                except (ValueError, TypeError) as exc:
                    handle.error = str(exc)
                    self._deliver(handle, None)
            elif kind == "cancel" and (handle := self._handles.get(arg)) is not None:
                if engine.cancel(arg):
                    handle.completion = engine.result(arg)
                    events = [
                        StreamEvent(arg, i, [], "", True, "abort") for i in range(handle.n) if i not in handle.finished
                    ]
                    self._deliver(handle, events)
                elif engine.has_request(arg):  # finished meanwhile: collect it
                    handle.completion = engine.result(arg)
                self._deliver(handle, None)

    def _dispatch(self, engine: LLMEngine, events: list[StreamEvent]) -> None:
        by_request: dict[str, list[StreamEvent]] = {}
        for ev in events:
            by_request.setdefault(ev.request_id, []).append(ev)
        items: list[tuple[Handle, list[StreamEvent] | None]] = []
        for rid, evs in by_request.items():
            handle = self._handles.get(rid)
            if handle is None:
                continue
            handle.finished.update(ev.index for ev in evs if ev.finished)
            items.append((handle, evs))
            if len(handle.finished) == handle.n:
                handle.completion = engine.result(rid)
                items.append((handle, None))
        if items:  # held back while the next step launches (if one follows)
            self._deliver_all(items, self._next_delay() if engine.has_unfinished() else 0.0)

    def _fail_all(self, engine: LLMEngine, message: str) -> None:
        for rid, handle in list(self._handles.items()):
            engine.cancel(rid)
            if engine.has_request(rid):
                engine.result(rid)
            handle.error = message
            self._deliver(handle, None)


def _put_all(items: list[tuple[Handle, list[StreamEvent] | None]]) -> None:
    for handle, item in items:
        handle.queue.put_nowait(item)
        if item is None:
            handle.ended = True
            callbacks, handle._on_end = handle._on_end, []
            for callback in callbacks:
                callback()
