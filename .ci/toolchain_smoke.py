"""Call, on CPU, the code that touches Triton/torch APIs outside their stable surface but runs only on CUDA.

The engine installs Triton's compile/autotune listeners (``triton.knobs``) only for a CUDA model, so no CPU test
reaches them; the function itself needs no device. Run by ``.ci/toolchain_job.sh`` (triton 3.6) and usable with any
installed Triton: ``python .ci/toolchain_smoke.py``.
"""

from __future__ import annotations

import importlib.util


def check_watch_triton() -> str:
    """``watch_triton`` installs its listeners on this Triton and ``done()`` puts the previous ones back."""
    from triton import knobs

    from lightning_llmopt.inference.startup import StartupLog, watch_triton

    def listeners() -> list[object]:
        return [getattr(getattr(knobs, group, None), "listener", None) for group in ("compilation", "autotuning")]

    before = listeners()
    log = StartupLog()
    watch_triton(log)
    log.done()
    after = listeners()
    if after != before:
        raise SystemExit(f"watch_triton: listeners after done() ({after}) differ from those before ({before})")
    return "watch_triton: installed and removed its listeners"


if __name__ == "__main__":
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("toolchain smoke: triton is not installed")
    import torch
    import triton

    print(f"toolchain smoke on torch {torch.__version__}, triton {triton.__version__}")
    print(check_watch_triton())
