"""Measured bubbles, per-action breakdowns and timeline pictures of pipeline steps.

Input: one :class:`~lightning_llmopt.parallel.pipeline_trace.StepTrace` per pipeline rank, all of the same step
(gather them, e.g. with ``dist.all_gather_object([t.to_dict()])``). Definitions:

- busy time of a rank: the union of its compute intervals (``F``, ``B``, ``I``, ``W``, ``L``);
- the step window: from the earliest rank start to the latest rank end (ranks aligned on the host clock, which is
  common to the processes of one host);
- measured bubble: ``1 - sum(busy) / (P * window)``, the definition of the plan's simulation
  (:mod:`~lightning_llmopt.parallel.pipeline_plan`), whose closed form for GPipe/1F1B is ``(P - 1) / (M + P - 1)``;
  per rank ``1 - busy / window``. It counts everything that is not compute as bubble: schedule dependencies, waits on
  transfers, host bookkeeping and stage imbalance (the embedding on the first stage, the head and loss on the last);
- bookkeeping: a rank's host time in the step outside every recorded action (the schedule's own Python);
- imbalance: the busiest rank's busy time over the mean.

:func:`draw_timelines` draws the measured timeline (per rank: forward, backward, input-gradient, weight-gradient,
loss, transfer waits; white is idle) above the theoretical one of the same ``P``, ``M`` and ``V``
(:func:`~lightning_llmopt.parallel.pipeline_plan.plan`, unit costs); :func:`draw_plan` draws the theoretical one alone
(``llmopt pipeline-plan --png``). Both need matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from lightning_llmopt.parallel.pipeline_plan import Plan, plan
from lightning_llmopt.parallel.pipeline_trace import COMPUTE_KINDS, StepTrace

__all__ = [
    "COLOURS",
    "bubble_summary",
    "draw_plan",
    "draw_timelines",
    "rank_breakdown",
    "theory_bubble",
    "union_seconds",
]

COLOURS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#c44e52",
    "W": "#55a868",
    "L": "#8172b3",
    "wait": "#bbbbbb",
    "p2p": "#555555",
}
_LABELS = {
    "F": "forward",
    "B": "backward (full)",
    "I": "backward, input grad",
    "W": "backward, weight grad",
    "L": "loss",
    "wait": "transfer wait",
    "p2p": "post send/recv",
}


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def rank_breakdown(trace: StepTrace) -> dict[str, Any]:
    """One rank's step: seconds and counts per action kind, busy (compute union), transfer waits, posting, host
    bookkeeping (host time outside every action) and the idle fraction of its own step."""
    kinds: dict[str, dict[str, float]] = {}
    for a in trace.actions:
        k = kinds.setdefault(a.kind, {"count": 0, "seconds": 0.0})
        k["count"] += 1
        k["seconds"] += a.end - a.start
    busy = union_seconds((a.start, a.end) for a in trace.actions if a.kind in COMPUTE_KINDS)
    host_actions = union_seconds((a.host_start, a.host_end) for a in trace.actions)
    return {
        "rank": trace.rank,
        "step_s": trace.duration,
        "host_step_s": trace.host_duration,
        "busy_s": busy,
        "wait_s": union_seconds((a.start, a.end) for a in trace.actions if a.kind == "wait"),
        "p2p_post_s": union_seconds((a.start, a.end) for a in trace.actions if a.kind in ("send", "recv", "sendrecv")),
        "bookkeeping_host_s": max(trace.host_duration - host_actions, 0.0),
        "idle_fraction_own_step": 1.0 - busy / trace.duration if trace.duration > 0 else 0.0,
        "actions": kinds,
    }


def _aligned(traces: Sequence[StepTrace]) -> tuple[list[float], float]:
    """Each rank's start offset (s) from the earliest rank start, and the common window length."""
    t0 = min(t.host_t0_ns for t in traces)
    offsets = [(t.host_t0_ns - t0) / 1e9 for t in traces]
    return offsets, max(o + t.duration for o, t in zip(offsets, traces, strict=True))


def theory_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The closed form where there is one (GPipe, 1F1B, interleaved), else the unit-cost simulation's figure."""
    p = plan(schedule, pp, microbatches, virtual_stages)
    return p.theory if p.theory is not None else p.bubble


def bubble_summary(
    traces: Sequence[StepTrace], schedule: str | None = None, microbatches: int | None = None, virtual_stages: int = 1
) -> dict[str, Any]:
    """Measured bubble of one step over all ranks (see the module docstring), per rank busy/idle, imbalance and
    breakdowns; with ``schedule`` and ``microbatches`` also the theoretical bubble and the gap in points."""
    if not traces:
        raise ValueError("bubble_summary needs the traces of at least one rank")
    traces = sorted(traces, key=lambda t: t.rank)
    _, window = _aligned(traces)
    ranks = [rank_breakdown(t) for t in traces]
    busy = [r["busy_s"] for r in ranks]
    out: dict[str, Any] = {
        "window_s": window,
        "measured_bubble": 1.0 - sum(busy) / (len(traces) * window),
        "busy_fraction_per_rank": [b / window for b in busy],
        "idle_fraction_per_rank": [1.0 - b / window for b in busy],
        "imbalance": max(busy) / statistics.fmean(busy) if statistics.fmean(busy) > 0 else 1.0,
        "bookkeeping_host_s_per_rank": [r["bookkeeping_host_s"] for r in ranks],
        "wait_s_per_rank": [r["wait_s"] for r in ranks],
        "ranks": ranks,
    }
    if schedule is not None and microbatches is not None:
        theory = theory_bubble(schedule, len(traces), microbatches, virtual_stages)
        out["theory_bubble"] = theory
        out["bubble_gap_points"] = 100.0 * (out["measured_bubble"] - theory)
    return out


# ------------------------------------------------------------------ pictures
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("timeline pictures need matplotlib: pip install 'lightning_llmopt[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, rows: Sequence[Sequence[tuple[float, float, str, str]]], xlabel: str, title: str) -> None:
    """``rows[r]`` = ``(start, end, colour key, text)`` bars of rank ``r``; idle stays white."""
    width = max((end for row in rows for _, end, _, _ in row), default=1.0) or 1.0
    for r, row in enumerate(rows):
        for start, end, key, text in row:
            tall = key not in ("wait", "p2p")
            ax.barh(
                r,
                end - start,
                left=start,
                height=0.8 if tall else 0.35,
                color=COLOURS[key],
                edgecolor="black" if tall else "none",
                linewidth=0.3,
            )
            if text and (end - start) > 0.009 * width:
                ax.text((start + end) / 2, r, text, ha="center", va="center", fontsize=5, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, width)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)


def _plan_rows(p: Plan) -> list[list[tuple[float, float, str, str]]]:
    label = (lambda op: f"{op.microbatch}.{op.stage}") if p.virtual_stages > 1 else (lambda op: f"{op.microbatch}")
    return [[(s, e, op.kind, label(op)) for s, e, op in rank] for rank in p.timeline]


def _trace_rows(traces: Sequence[StepTrace], multi: bool) -> list[list[tuple[float, float, str, str]]]:
    offsets, _ = _aligned(traces)
    rows = []
    for off, t in zip(offsets, traces, strict=True):
        row = []
        for a in t.actions:
            key = a.kind if a.kind in COLOURS else "p2p"
            text = "" if a.kind not in COMPUTE_KINDS or a.kind == "L" else f"{a.microbatch}"
            if multi and text:
                text += f".{a.stage}"
            row.append((off + a.start, off + a.end, key, text))
        rows.append(row)
    return rows


def _legend(fig: Any, kinds: Iterable[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLOURS[k], edgecolor="black", linewidth=0.3, label=_LABELS[k]) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=0.3, label="idle"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)


def _plan_title(p: Plan) -> str:
    theory = f", closed form {p.theory:.3f}" if p.theory is not None else ""
    return (
        f"theoretical {p.schedule} P={p.pp} M={p.microbatches} V={p.virtual_stages} (unit costs F=1, B=2, I=W=1, "
        f"free transfers): bubble {p.bubble:.3f}{theory}"
    )


def draw_plan(p: Plan, path: str) -> None:
    """The theoretical timeline of a :class:`~lightning_llmopt.parallel.pipeline_plan.Plan` as a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(max(8.0, p.makespan * 0.18), 40.0), 0.45 * p.pp + 1.6))
    _bars(ax, _plan_rows(p), "time (forward passes)", _plan_title(p))
    _legend(fig, [k for k in ("F", "B", "I", "W") if any(op.kind == k for r in p.timeline for _, _, op in r)])
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def draw_timelines(
    traces: Sequence[StepTrace],
    path: str,
    schedule: str,
    microbatches: int,
    virtual_stages: int = 1,
    title: str = "",
) -> None:
    """Measured timeline of one step (all ranks, aligned) above the theoretical one of the same P, M and V."""
    plt = _pyplot()
    traces = sorted(traces, key=lambda t: t.rank)
    summary = bubble_summary(traces, schedule, microbatches, virtual_stages)
    p = plan(schedule, len(traces), microbatches, virtual_stages)
    width = min(max(10.0, p.makespan * 0.18), 40.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 0.9 * len(traces) + 3.0))
    unit = "ms" if summary["window_s"] < 10 else "s"
    scale = 1e3 if unit == "ms" else 1.0
    rows = [[(s * scale, e * scale, k, t) for s, e, k, t in row] for row in _trace_rows(traces, virtual_stages > 1)]
    device = traces[0].device
    measured = (
        f"measured {schedule} P={len(traces)} M={microbatches} V={virtual_stages} on {device}{title}: "
        f"bubble {summary['measured_bubble']:.3f} (theory {summary['theory_bubble']:.3f}), "
        f"busy/rank {', '.join(f'{b:.2f}' for b in summary['busy_fraction_per_rank'])}"
    )
    _bars(top, rows, f"time ({unit})", measured)
    _bars(bottom, _plan_rows(p), "time (forward passes)", _plan_title(p))
    seen = {k for row in rows for _, _, k, _ in row} | {op.kind for r in p.timeline for _, _, op in r}
    _legend(fig, [k for k in COLOURS if k in seen])
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)
