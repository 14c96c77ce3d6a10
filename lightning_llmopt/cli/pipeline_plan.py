"""``llmopt pipeline-plan``: each rank's F/B/W timeline of a pipeline schedule and its bubble fraction.

    llmopt pipeline-plan --schedule 1f1b --pp 4 --microbatches 8 [--virtual-stages 2] [--png plan.png]
    llmopt pipeline-plan --all --pp 4 --microbatches 8        # every schedule, one table

Times are in units of one forward pass (backward 2, or input-gradient 1 + weight-gradient 1 for zero-bubble
schedules; communication free), see :mod:`lightning_llmopt.parallel.pipeline_plan`. The PNG needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_llmopt.parallel.pipeline import SCHEDULES
from lightning_llmopt.parallel.pipeline_plan import Plan, plan

__all__ = ["build_parser", "main", "render_text"]


def render_text(p: Plan) -> str:
    """One line per rank: ``F3`` = forward of micro-batch 3 (``F3.1``: stage 1 of several on the rank); ``.`` idle."""
    width = max(2 + len(str(p.microbatches)) + (2 if p.virtual_stages > 1 else 0), 3)
    lines = [f"schedule {p.schedule}: pp={p.pp} microbatches={p.microbatches} virtual_stages={p.virtual_stages}"]
    for r, ops in enumerate(p.timeline):
        cells, t = [], 0.0
        for start, end, op in ops:
            cells += ["." * width] * int(round(start - t))
            label = f"{op.kind}{op.microbatch}" + (f".{op.stage}" if p.virtual_stages > 1 else "")
            cells += [label.ljust(width)] * int(round(end - start))
            t = end
        cells += ["." * width] * int(round(p.makespan - t))
        lines.append(f"rank {r}: " + " ".join(cells))
    theory = f"{p.theory:.4f}" if p.theory is not None else "n/a (zero bubble: see the simulated figure)"
    lines.append(f"bubble: simulated {p.bubble:.4f}, theoretical {theory}; makespan {p.makespan:g} forward units")
    return "\n".join(lines)


def write_png(p: Plan, path: str) -> bool:
    """Draw the theoretical timeline (:func:`~lightning_llmopt.parallel.pipeline_timeline.draw_plan`, labelled
    theoretical); ``False`` (and a message) without matplotlib."""
    from lightning_llmopt.parallel.pipeline_timeline import draw_plan

    try:
        draw_plan(p, path)
    except ImportError as exc:
        print(f"{exc}: {path} not written", file=sys.stderr)
        return False
    return True


def _two_bw_line(pp: int, m: int) -> str:
    """PipeDream-2BW's steady-state time per batch (``parallel.pipeline_2bw.simulate_windows``, same unit costs)."""
    from lightning_llmopt.parallel.pipeline_2bw import simulate_windows

    if m < pp:
        return f"pipedream_2bw: cannot plan pp={pp} microbatches={m}: microbatches must be >= pp"
    free, synced = (simulate_windows(pp, m, 8, sync) for sync in (False, True))
    per_free, per_sync = free[7] - free[6], synced[7] - synced[6]
    return (
        f"pipedream_2bw     V=1  no flush: steady-state time per batch {per_free:g} "
        f"(bubble {1 - 3 * m / per_free:.4f}), {per_sync:g} with the per-step loss broadcast "
        f"(bubble {1 - 3 * m / per_sync:.4f}); 1F1B {3 * (m + pp - 1)}"
    )


def build_parser() -> argparse.ArgumentParser:
    from lightning_llmopt.cli import options

    parser = options.parser(
        "llmopt pipeline-plan",
        "Each rank's timeline of a pipeline schedule (F forward, B backward, W weight gradient) and its bubble "
        "fraction, in units of one forward pass (communication free).",
    )
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b", help="the schedule to plan")
    parser.add_argument("--all", action="store_true", help="a bubble table of every schedule instead of a timeline")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks P")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches M")
    parser.add_argument(
        "--virtual-stages",
        "-v",
        type=int,
        default=None,
        help="stages per rank V (default: 2 for the interleaved and V schedules, else 1)",
    )
    parser.add_argument("--png", default=None, help="write the theoretical timeline as a PNG (the plot extra)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``llmopt pipeline-plan``: prints the plan (or, with ``--all``, the table)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.png and (args.all or args.schedule == "pipedream_2bw"):
        what = "--all" if args.all else "pipedream_2bw (it never flushes: there is no per-batch timeline)"
        parser.error(f"--png draws one schedule's timeline, not {what}")
    if args.pp < 2 or args.microbatches < 1:
        parser.error(f"--pp ({args.pp}) must be >= 2 and --microbatches ({args.microbatches}) >= 1")
    names = sorted(SCHEDULES) if args.all else [args.schedule]
    for name in names:
        if name == "pipedream_2bw":  # never flushes: no per-batch plan, the steady state per batch instead
            print(_two_bw_line(args.pp, args.microbatches))
            continue
        v = args.virtual_stages if args.virtual_stages is not None else SCHEDULES[name][3]
        if not SCHEDULES[name][1]:
            v = 1
        try:
            p = plan(name, args.pp, args.microbatches, v)
        except (ValueError, NotImplementedError, AssertionError) as exc:
            print(f"{name}: cannot plan pp={args.pp} microbatches={args.microbatches} virtual_stages={v}: {exc}")
            continue
        if args.all:
            theory = f"{p.theory:.4f}" if p.theory is not None else "   n/a"
            print(f"{name:17s} V={v}  simulated bubble {p.bubble:.4f}  theoretical {theory}")
        else:
            print(render_text(p))
            if args.png:
                if write_png(p, args.png):
                    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
