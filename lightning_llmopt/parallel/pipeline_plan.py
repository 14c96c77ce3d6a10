"""Timelines and bubble fractions of pipeline schedules (pure; used by ``llmopt pipeline-plan`` and the benchmark).

Each rank's ordered list of operations (stage, ``F`` forward / ``B`` full backward / ``I`` input-gradient backward /
``W`` weight-gradient backward, micro-batch) is simulated with fixed costs: an operation starts when its rank is free
and its inputs exist (``F`` of stage ``s`` after ``F`` of ``s - 1``; ``B``/``I`` of ``s`` after ``B``/``I`` of
``s + 1``, or after its own ``F`` on the last stage; ``W`` after its ``I``). Communication is free. The bubble is
the idle fraction of ``ranks x makespan``.

Orders: GPipe and 1F1B are generated here; multi-stage schedules (interleaved, zero bubble, ZBV, DualPipeV) come
from torch's own schedule tables (``torch.distributed.pipelining``'s schedule builder, run with stand-in stages).

Theory (ANCHORS): GPipe and 1F1B ``(P - 1) / (M + P - 1)``; interleaved 1F1B with ``V`` stages per rank
``(P - 1) / (V M + P - 1)``; zero-bubble schedules (arXiv 2401.10241) fill the bubble with ``W`` passes, so their
figure is the simulated one with ``T_F = T_I = T_W`` (the paper's setting), near zero once ``M`` is large enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Op", "Plan", "plan", "schedule_orders", "simulate", "theoretical_bubble"]

# zero-bubble schedules split the backward: I + W = B
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
_TORCH_NAMES = {
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


class Op(NamedTuple):
    stage: int
    kind: str  # F, B, I or W
    microbatch: int


@dataclass
class Plan:
    """A simulated schedule: per rank ``(start, end, op)`` triples, the makespan and bubble fractions."""

    schedule: str
    pp: int
    microbatches: int
    virtual_stages: int
    timeline: list[list[tuple[float, float, Op]]] = field(default_factory=list)
    makespan: float = 0.0
    bubble: float = 0.0
    theory: float | None = None


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float | None:
    """The closed-form bubble fraction, or ``None`` for zero-bubble schedules (use the simulated figure)."""
    p, m, v = pp, microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Op]:
    warmup = min(pp - rank - 1, m)
    ops = [Op(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op(rank, "F", warmup + i), Op(rank, "B", i)]
    return ops + [Op(rank, "B", i) for i in range(m - warmup, m)]


def schedule_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Op]]:
    """Each rank's operations in execution order."""
    m = microbatches
    if schedule == "gpipe":
        return [[Op(r, "F", i) for i in range(m)] + [Op(r, "B", i) for i in range(m)] for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, m, r) for r in range(pp)]
    if schedule not in _TORCH_NAMES:
        raise ValueError(f"schedule ({schedule!r}) must be one of {['gpipe', '1f1b', *_TORCH_NAMES]}")
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as exc:  # private module: present in torch 2.8 to 2.13
        raise NotImplementedError(f"the {schedule!r} plan needs torch's schedule visualizer") from exc
    orders: list[list[Op]] = []
    for actions in get_schedule_ops(_TORCH_NAMES[schedule], pp, m, num_stages_per_rank=virtual_stages):
        ops: list[Op] = []
        flat = [x for a in actions if a is not None for x in (a.sub_actions or [a])]  # DualPipeV overlaps F and B
        for a in flat:
            kind = str(getattr(a, "computation_type", "")).split(".")[-1] if a is not None else ""
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
                kind, kind if kind in COSTS else ""
            )
            if kind:
                ops.append(Op(a.stage_index, kind, a.microbatch_index))
        orders.append(ops)
    return orders


def simulate(orders: list[list[Op]], num_stages: int) -> tuple[list[list[tuple[float, float, Op]]], float]:
    """Start/end time of every operation (see the module docstring); returns the timeline and the makespan."""
    done: dict[tuple[int, str, int], float] = {}
    pos = [0] * len(orders)
    free = [0.0] * len(orders)
    timeline: list[list[tuple[float, float, Op]]] = [[] for _ in orders]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                op = order[pos[r]]
                deps = _deps(op, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                end = start + COSTS[op.kind]
                done[(op.stage, "B" if op.kind in "BI" else op.kind, op.microbatch)] = end
                timeline[r].append((start, end, op))
                free[r], pos[r], remaining, progressed = end, pos[r] + 1, remaining - 1, True
        if not progressed:
            raise ValueError("the schedule's operation orders deadlock (an input never becomes ready)")
    return timeline, max(free)


def _deps(op: Op, num_stages: int) -> list[tuple[int, str, int]]:
    s, m = op.stage, op.microbatch
    if op.kind == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    if op.kind in "BI":
        return [(s + 1, "B", m)] if s < num_stages - 1 else [(s, "F", m)]
    return [(s, "B", m)]  # W after its input-gradient pass


def plan(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Plan:
    """Simulate ``schedule`` for ``pp`` ranks and ``microbatches`` micro-batches."""
    orders = schedule_orders(schedule, pp, microbatches, virtual_stages)
    timeline, makespan = simulate(orders, pp * virtual_stages)
    busy = sum(end - start for rank in timeline for start, end, _ in rank)
    return Plan(
        schedule,
        pp,
        microbatches,
        virtual_stages,
        timeline,
        makespan,
        1.0 - busy / (pp * makespan),
        theoretical_bubble(schedule, pp, microbatches, virtual_stages),
    )
