"""Action-level timing of a pipeline step: what each rank did, when, for which stage and micro-batch.

Opt-in and off by default: :class:`~lightning_llmopt.parallel.pipeline.PipelineRunner` has ``recorder = None``, and
then nothing here is installed. With ``runner.recorder = ActionRecorder()`` every ``train_step`` records, on this
rank, one :class:`StepTrace`. Steps:

1. :meth:`ActionRecorder.step` ``(rank, schedule, stages)`` (a context around ``schedule.step``; the runner enters it)
   wraps, on the instances only, each local stage's ``forward_one_chunk`` (``F``), ``backward_one_chunk`` (``B`` for
   a full backward, ``I`` for the input-gradient half of a split one), ``backward_weight_one_chunk`` (``W``), the
   schedule's ``_maybe_compute_loss`` (``L``, last stage only) and the stage's ``get_{fwd,bwd}_{send,recv}_ops``
   (which only tag the point-to-point ops they return with their direction, stage and micro-batch).
2. It also swaps ``torch.distributed.pipelining.schedules``' ``_batch_p2p`` (posting sends/receives: ``send``,
   ``recv`` or ``sendrecv``) and ``_wait_batch_p2p`` (``wait``) for timed versions. On exit everything is restored:
   outside a recorded step nothing of this module is installed. Both are private torch functions (checked on torch
   2.13, where every schedule posts and waits through them); where a torch lacks them only the compute actions are
   recorded, and where it waits on transfers without ``_wait_batch_p2p`` the waits count as idle time.
3. Each action gets host times (``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux, so comparable across the
   processes of one host) and, on CUDA, device times from a pair of CUDA events on the current stream, read after
   the step (one ``torch.cuda.synchronize``): on a GPU compute is asynchronous, so the device times are the ones
   that say when the stream worked; a ``wait``'s device interval is the time the stream stalled on a transfer.
4. The host time of the step outside every recorded action is the schedule's own bookkeeping (Python between
   actions); :mod:`~lightning_llmopt.parallel.pipeline_timeline` turns traces into busy/idle fractions and pictures.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["COMPUTE_KINDS", "ActionRecord", "ActionRecorder", "StepTrace"]

COMPUTE_KINDS = ("F", "B", "I", "W", "L")  # forward, full backward, input-gradient, weight-gradient, loss
_TAGS = {
    "get_fwd_send_ops": "send F",
    "get_fwd_recv_ops": "recv F",
    "get_bwd_send_ops": "send B",
    "get_bwd_recv_ops": "recv B",
}


@dataclass
class ActionRecord:
    """One action on one rank. Times are seconds from the step's start: ``start``/``end`` on the device clock on
    CUDA (else equal to the host ones), ``host_start``/``host_end`` on the host clock.

    Arguments:
        kind: ``F``, ``B``, ``I``, ``W``, ``L`` (compute) or ``send``, ``recv``, ``sendrecv``, ``wait`` (transfers).
        stage: stage index (for transfers: of the first tagged op), or ``None``.
        microbatch: micro-batch index, or ``None``.
        detail: for transfers, the tagged ops, e.g. ``"recv F s1 m3"``.
    """

    kind: str
    stage: int | None
    microbatch: int | None
    start: float
    end: float
    host_start: float
    host_end: float
    detail: str = ""


@dataclass
class StepTrace:
    """The actions of one recorded step on one rank.

    Arguments:
        rank: the rank in the pipeline group.
        host_t0_ns: ``time.perf_counter_ns()`` at the step's start (aligns the ranks of one host).
        duration: the step's length in seconds (device clock on CUDA).
        host_duration: the step's length on the host clock.
        device: ``"cuda"`` or ``"cpu"`` (which clock ``start``/``end`` use).
        actions: in execution order.
    """

    rank: int
    host_t0_ns: int
    duration: float
    host_duration: float
    device: str
    actions: list[ActionRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTrace:
        actions = [ActionRecord(**a) for a in data.get("actions", [])]
        return cls(**{**data, "actions": actions})


class ActionRecorder:
    """Records the actions of pipeline steps (see the module docstring).

    Arguments:
        cuda_events: time actions with CUDA events (``None``: when CUDA is initialised in this process).
        keep: how many step traces :attr:`traces` keeps (the most recent).
    """

    def __init__(self, cuda_events: bool | None = None, keep: int = 8) -> None:
        self.cuda_events = cuda_events
        self.keep = keep
        self.traces: list[StepTrace] = []
        self._active = False
        self._depth = 0
        self._pending: list[tuple[str, int | None, int | None, int, int, Any, Any, str]] = []
        self._tags: dict[int, tuple[Any, str]] = {}
        self._work_tags: dict[int, tuple[Any, list[str]]] = {}
        self._use_events = False

    # ---------------------------------------------------------------- installation
    _STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", *_TAGS)

    def _attach(self, schedule: Any, stages: list[Any]) -> list[tuple[Any, str]]:
        """Wrap the methods of ``schedule`` and its local ``stages`` (instance attributes shadowing the class's);
        returns what :meth:`_detach` removes."""
        for stage in stages:
            if any(name in vars(stage) for name in self._STAGE_METHODS):
                raise RuntimeError(f"stage {stage.stage_index} already has instance-level pipeline methods")
        if "_maybe_compute_loss" in vars(schedule):
            raise RuntimeError("the schedule already has an instance-level _maybe_compute_loss")
        installed: list[tuple[Any, str]] = []
        for stage in stages:
            idx = int(stage.stage_index)
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, functools.partial(_labelled, "F", idx))
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, functools.partial(_backward_kind, idx))
            stage.backward_weight_one_chunk = self._timed(
                stage.backward_weight_one_chunk, functools.partial(_labelled, "W", idx)
            )
            for name, tag in _TAGS.items():
                setattr(stage, name, self._tagging(getattr(stage, name), tag, idx))
            installed += [(stage, name) for name in self._STAGE_METHODS]
        schedule._maybe_compute_loss = self._timed(schedule._maybe_compute_loss, _loss_kind, when=_is_loss)
        return [*installed, (schedule, "_maybe_compute_loss")]

    @staticmethod
    def _detach(installed: list[tuple[Any, str]]) -> None:
        for obj, name in installed:
            obj.__dict__.pop(name, None)

    def _timed(
        self,
        fn: Callable[..., Any],
        label: Callable[[tuple, dict], tuple[str, int | None, int | None]],
        when: Any = None,
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._active or self._depth or (when is not None and not when(args, kwargs)):
                return fn(*args, **kwargs)
            kind, stage, mb = label(args, kwargs)
            return self._run(fn, args, kwargs, kind, stage, mb, "")

        return wrapper

    def _tagging(self, fn: Callable[..., Any], tag: str, stage: int) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
            ops = fn(chunk, *args, **kwargs)
            if self._active:
                for op in ops:
                    self._tags[id(op)] = (op, f"{tag} s{stage} m{chunk}")
            return ops

        return wrapper

    def _run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        kind: str,
        stage: int | None,
        mb: int | None,
        detail: str,
    ) -> Any:
        before = after = None
        if self._use_events:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        self._depth += 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter_ns()
            self._depth -= 1
            if self._use_events:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
            self._pending.append((kind, stage, mb, t0, t1, before, after, detail))

    # ---------------------------------------------------------------- point-to-point
    def _batch_p2p(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def batch(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            if not p2p_ops or self._depth:
                return orig(p2p_ops, *args, **kwargs)
            tags = [self._tags.get(id(op), (None, "untagged"))[1] for op in p2p_ops]
            directions = {t.split()[0] for t in tags}
            kind = directions.pop() if len(directions) == 1 and "untagged" not in tags else "sendrecv"
            stage, mb = _stage_mb(tags[0])
            works = self._run(orig, (p2p_ops, *args), kwargs, kind, stage, mb, "; ".join(tags))
            self._work_tags[id(works)] = (works, tags)
            return works

        return batch

    def _wait_p2p(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def wait(work: list[Any], *args: Any, **kwargs: Any) -> Any:
            if not work or self._depth:
                return orig(work, *args, **kwargs)
            tags = self._work_tags.get(id(work), (None, ["untagged"]))[1]
            stage, mb = _stage_mb(tags[0])
            return self._run(orig, (work, *args), kwargs, "wait", stage, mb, "; ".join(tags))

        return wait

    # ---------------------------------------------------------------- one step
    @contextmanager
    def step(self, rank: int, schedule: Any, stages: list[Any]) -> Iterator[None]:
        """Record the actions of ``schedule`` and its local ``stages`` run inside this context as one
        :class:`StepTrace` of pipeline rank ``rank``."""
        from torch.distributed.pipelining import schedules

        use = self.cuda_events if self.cuda_events is not None else torch.cuda.is_initialized()
        self._use_events = bool(use) and torch.cuda.is_available()
        installed = self._attach(schedule, stages)  # before the patch below: it may raise
        saved = {n: getattr(schedules, n, None) for n in ("_batch_p2p", "_wait_batch_p2p")}
        if saved["_batch_p2p"] is not None and saved["_wait_batch_p2p"] is not None:
            schedules._batch_p2p = self._batch_p2p(saved["_batch_p2p"])  # type: ignore[attr-defined]
            schedules._wait_batch_p2p = self._wait_p2p(saved["_wait_batch_p2p"])  # type: ignore[attr-defined]
        self._pending, self._tags, self._work_tags = [], {}, {}
        start_event = None
        if self._use_events:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        t0 = time.perf_counter_ns()
        self._active = True
        try:
            yield
        finally:
            self._active = False
            t1 = time.perf_counter_ns()
            end_event = None
            if self._use_events:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
            for name, fn in saved.items():
                if fn is not None:
                    setattr(schedules, name, fn)
            self._detach(installed)
            self._finish(rank, t0, t1, start_event, end_event)

    def _finish(self, rank: int, t0: int, t1: int, start_event: Any, end_event: Any) -> None:
        if self._use_events:
            torch.cuda.synchronize()

        def dev(event: Any, host_ns: int) -> float:
            if event is None or start_event is None:
                return (host_ns - t0) / 1e9
            return float(start_event.elapsed_time(event)) / 1e3

        actions = [
            ActionRecord(kind, stage, mb, dev(b, h0), dev(a, h1), (h0 - t0) / 1e9, (h1 - t0) / 1e9, detail)
            for kind, stage, mb, h0, h1, b, a, detail in self._pending
        ]
        trace = StepTrace(rank, t0, dev(end_event, t1), (t1 - t0) / 1e9, "cuda" if self._use_events else "cpu", actions)
        self.traces = [*self.traces, trace][-self.keep :]
        self._pending, self._tags, self._work_tags = [], {}, {}

    @property
    def last(self) -> StepTrace:
        """The most recent trace."""
        if not self.traces:
            raise RuntimeError("no recorded pipeline step yet (set runner.recorder before train_step)")
        return self.traces[-1]


def _chunk(args: tuple, kwargs: dict) -> int | None:
    for key in ("fwd_chunk_id", "bwd_chunk_id"):
        if key in kwargs:
            return int(kwargs[key])
    return int(args[0]) if args else None


def _labelled(kind: str, stage: int, args: tuple, kwargs: dict) -> tuple[str, int | None, int | None]:
    return kind, stage, _chunk(args, kwargs)


def _backward_kind(stage: int, args: tuple, kwargs: dict) -> tuple[str, int | None, int | None]:
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return ("B" if full else "I"), stage, _chunk(args, kwargs)


def _is_loss(args: tuple, kwargs: dict) -> bool:
    stage = args[0] if args else kwargs.get("stage")
    return bool(getattr(stage, "is_last", False))


def _loss_kind(args: tuple, kwargs: dict) -> tuple[str, int | None, int | None]:
    stage: Any = args[0] if args else kwargs.get("stage")
    mb = args[3] if len(args) > 3 else kwargs.get("mb_index")
    return "L", int(stage.stage_index), None if mb is None else int(mb)


def _stage_mb(tag: str) -> tuple[int | None, int | None]:
    parts = tag.split()
    if len(parts) == 4 and parts[2].startswith("s") and parts[3].startswith("m"):
        return int(parts[2][1:]), int(parts[3][1:])
    return None, None
