"""Progress reporting for the long CLI commands (``quantize``, ``consolidate``, ``export``).

On a terminal a tqdm bar (tqdm comes with Lightning) shows the count, the rate and the time left; otherwise
(a log file, a pipe, CI) one line is printed at most every ``interval`` seconds and at the end, e.g.::

    [quantize] 12/28 layers (42.9%), 3.1 layers/s, 5 s elapsed, ETA 5 s

Everything goes to stderr, so a command's own output on stdout stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["Progress", "line_progress_bar"]


class Progress:
    """A counter of ``total`` units named ``unit``, shown as a bar on a terminal and as periodic lines otherwise.

    Arguments:
        desc: what is being done (the line's prefix).
        total: the number of units (``None`` when unknown: no percentage or ETA).
        unit: the unit's name, e.g. ``"layers"``, ``"tensors"``.
        stream: where to write (default ``sys.stderr``).
        interval: seconds between two lines when not on a terminal.
        bar: force the bar on or off (default: on when ``stream`` is a terminal).
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str = "it",
        stream: IO[str] | None = None,
        interval: float = 10.0,
        bar: bool | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self._start = self._last = time.monotonic()
        use_bar = bar if bar is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True)
        else:
            todo = f"{total} {unit}" if total is not None else unit
            print(f"[{desc}] started: {todo}", file=self.stream, flush=True)

    def line(self) -> str:
        """The text of one periodic line for the current count."""
        elapsed = time.monotonic() - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        text = f"[{self.desc}] {self.n}"
        if self.total:
            text += f"/{self.total} {self.unit} ({100.0 * self.n / self.total:.1f}%)"
        else:
            text += f" {self.unit}"
        text += f", {rate:.3g} {self.unit}/s, {elapsed:.0f} s elapsed"
        if self.total and 0 < rate and self.n < self.total:
            text += f", ETA {(self.total - self.n) / rate:.0f} s"
        return text

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Count ``n`` more units done; ``postfix`` names the last one (shown on the bar)."""
        self.n += n
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval or (self.total is not None and self.n >= self.total):
            self._last = now
            print(self.line() + (f" [{postfix}]" if postfix else ""), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _line_progress_bar() -> Any:
    """A Lightning progress-bar callback that prints a line at most every ``interval`` seconds (for logs and pipes,
    where tqdm's carriage returns pile up): ``[fit] step 120/300 (40.0%), 5.12 steps/s, ETA 35 s, train/loss=2.31``.
    Built lazily so this module imports no Lightning."""
    from lightning.pytorch.callbacks import ProgressBar

    class LineProgressBar(ProgressBar):
        def __init__(self, interval: float = 10.0, stream: IO[str] | None = None) -> None:
            super().__init__()
            self.interval, self.stream = interval, stream
            self._enabled = True
            self._start = self._last = 0.0
            self._first_step = 0

        def disable(self) -> None:
            self._enabled = False

        def enable(self) -> None:
            self._enabled = True

        def _print(self, text: str) -> None:
            if self._enabled and self.trainer.is_global_zero:
                print(text, file=self.stream if self.stream is not None else sys.stderr, flush=True)

        def _metrics(self) -> str:
            items = self.get_metrics(self.trainer, self.trainer.lightning_module)
            return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items.items())

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._start = self._last = time.monotonic()
            self._first_step = trainer.global_step
            total = trainer.max_steps if trainer.max_steps > 0 else None
            self._print(f"[fit] training started: {total if total else '?'} steps")

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            now = time.monotonic()
            step, total = trainer.global_step, trainer.max_steps if trainer.max_steps > 0 else None
            if now - self._last < self.interval and step != total:
                return
            self._last = now
            rate = (step - self._first_step) / max(now - self._start, 1e-9)
            text = f"[fit] step {step}"
            if total:
                text += f"/{total} ({100.0 * step / total:.1f}%)"
            text += f", {rate:.3g} steps/s, {now - self._start:.0f} s elapsed"
            if total and rate > 0 and step < total:
                text += f", ETA {(total - step) / rate:.0f} s"
            self._print(f"{text}, {self._metrics()}")

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
                shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(val.items()))
                stage = getattr(trainer.state.fn, "value", "fit")
                self._print(f"[{stage}] validation at step {trainer.global_step}: {shown}")

    return LineProgressBar


def line_progress_bar(interval: float = 10.0, stream: IO[str] | None = None) -> Any:
    """A :class:`lightning.pytorch.callbacks.ProgressBar` printing periodic lines (see :func:`_line_progress_bar`)."""
    return _line_progress_bar()(interval, stream)
