"""CPU audit of one tensor-parallel training step: ours (``tp<d>``) against Lightning's DTensor TP plan.

Both variants are built as ``bench_nd_parallel.py`` builds them (``_build``), on gloo, bf16-mixed, a scaled-down
``1b`` shape (head_dim 64, 4 query heads per kv head, ffn 2.75x dim, vocab ~16x dim). Each variant trains 2 steps with
2 and with 4 layers (4 ``torchrun`` launches per variant); per layer = (4 layers - 2 layers) / 2, the rest is the
embedding, head, loss and optimizer. Step 0 records the bytes saved for backward (unique storages); step 1 runs under
``torch.profiler`` (record_shapes) with the phases forward / backward / grad_sync (after backward, before the
optimizer) / optimizer, and counts on rank 0: collectives (kind, dtype, size of the unsharded tensor), outermost ops on
local tensors, DTensor dispatches, and copies (``_to_copy``, ``copy_``, ``cat``, ``clone``; outermost only).

    python benchmarks/audit_tp.py                       # tp2 vs lightning-tp2, prints the per-layer table
    python benchmarks/audit_tp.py --variants tp2 --seq-len 512
    python benchmarks/audit_tp.py --nproc 4 --variants tp4 lightning-tp4 --model-overrides '{"n_kv_heads": 4}'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

MODEL = {"vocab_size": 8000, "dim": 512, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden_dim": 1408, "max_seq_len": 1024}
PHASES = ("forward", "backward", "grad_sync", "optimizer")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone")
BYTES = {"float": 4, "c10::BFloat16": 2}


def _record(prof: Any, world: int) -> dict[str, Any]:
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name[6:]) for e in events if e.name.startswith("phase:")]
    out: dict[str, Any] = {p: collections.Counter() for p in PHASES}

    def dtensor_level(e: Any) -> bool:  # an op on DTensors: its local work runs under a PythonSubclass child
        return any(c.name == "PythonSubclass" for c in e.cpu_children)

    def inside(e: Any, names: tuple[str, ...] | None) -> bool:  # under another op on local tensors (of `names`)
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::") and not dtensor_level(p) and (names is None or p.name in names):
                return True
            p = p.cpu_parent
        return False

    for e in events:
        phase = next((n for s, t, n in spans if s <= e.time_range.start <= t), None)
        if phase is None or e.name.startswith("phase:"):
            continue
        c = out[phase]
        if e.name.startswith("_c10d_functional::") and not e.name.endswith(("wait_tensor", "_wrap_tensor_autograd")):
            kind, dtype = e.name.split("::")[1], e.input_dtypes[0]
            numel = 1
            for size in e.input_shapes[0]:
                numel *= size
            full = numel * (world if kind == "all_gather_into_tensor" else 1)  # the unsharded tensor
            c[f"{kind} {dtype}"] += 1
            c[f"bytes {kind} {dtype}"] += full * BYTES.get(dtype, 0)
        elif e.name.startswith("c10d_py::"):  # our own torch.distributed calls, named by _patch_dist
            kind, dtype, numel = e.name[9:].split("|")
            c[f"{kind} {dtype}"] += 1
            c[f"bytes {kind} {dtype}"] += int(numel) * BYTES.get(dtype, 0)
        elif e.name.startswith("aten::"):
            if dtensor_level(e):
                c["DTensor dispatches"] += 0 if _under_dtensor_op(e, dtensor_level) else 1
            elif not inside(e, None):
                c["local ops"] += 1
            if e.name in COPIES and not dtensor_level(e) and not inside(e, COPIES):
                c["copies"] += 1
    return {p: dict(v) for p, v in out.items()}


def _under_dtensor_op(e: Any, dtensor_level: Any) -> bool:
    p = e.cpu_parent
    while p is not None and not (p.name.startswith("aten::") and dtensor_level(p)):
        p = p.cpu_parent
    return p is not None


def _patch_dist() -> None:
    """Name each ``torch.distributed`` call by dtype and size (the profiler records no shapes for tensor lists)."""
    import torch.distributed as dist
    from torch.profiler import record_function

    def wrap(name: str, fn: Any) -> Any:
        def inner(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            dtype = {"torch.float32": "float", "torch.bfloat16": "c10::BFloat16"}.get(str(tensor.dtype), "?")
            with record_function(f"c10d_py::{name}|{dtype}|{tensor.numel()}"):
                return fn(tensor, *args, **kwargs)

        return inner

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _callback(out_path: str, world: int) -> Any:
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile, record_function

    class Audit(Callback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.phase: Any = None
            self.saved: dict[int, int] = {}

        def _pack(self, t: Any) -> Any:
            local = getattr(t, "_local_tensor", t)
            try:
                self.saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            except RuntimeError:  # an async collective's output not waited on yet
                self.saved[-id(local)] = local.numel() * local.element_size()
            return t

        def _enter(self, name: str | None) -> None:
            if self.prof is not None:
                if self.phase is not None:
                    self.phase.__exit__(None, None, None)
                self.phase = record_function(f"phase:{name}") if name else None
                if self.phase is not None:
                    self.phase.__enter__()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
                self.hooks.__enter__()
            else:
                self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                self.prof.__enter__()
                self._enter("forward")

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self.prof is None:
                self.hooks.__exit__(None, None, None)
            self._enter("backward")

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._enter("grad_sync")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._enter("optimizer")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.prof is not None:
                self._enter(None)
                self.prof.__exit__(None, None, None)
                if int(os.environ["RANK"]) == 0:
                    row = {**_record(self.prof, world), "saved_bytes": sum(self.saved.values())}
                    Path(out_path).write_text(json.dumps(row))
                sys.stdout.flush()
                os._exit(0)  # the profiler's shape records hold weakrefs that break Lightning's teardown

    return Audit()


def worker(args: argparse.Namespace) -> None:
    import bench_nd_parallel as bench
    import lightning as L
    import torch

    from lightning_llmopt.testing.data import RandomTokens

    world = int(os.environ["WORLD_SIZE"])
    spec = bench.parse_variant(args.variant)
    model = json.dumps({**MODEL, **json.loads(args.model_overrides)})
    bench_args = argparse.Namespace(
        preset="1b", layers=args.layers, model_overrides=model, seq_len=args.seq_len, warmup_steps=1, steps=1,
        precision="bf16-mixed", activation_checkpointing="none", compile=False, smoke=True,
    )  # fmt: skip
    L.seed_everything(0, verbose=False)
    strategy, module, dp = bench._build(bench_args, world, spec)
    _patch_dist()
    data = RandomTokens(module.config.vocab_size, args.seq_len, 2 * dp, seed=1234)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[_callback(args.out, world)],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))


def _line(counts: dict[str, float]) -> str:
    short = {"all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter"}
    short["all_reduce"] = "all-reduce"
    parts = []
    for key, n in sorted(counts.items()):
        kib = counts.get(f"bytes {key}", 0) / 1024
        if (n or kib) and key.split()[0] in short:  # x0 with bytes: one collective that grows with the layers
            kind, dtype = key.split()
            parts.append(f"{short[kind]} {'bf16' if 'BFloat16' in dtype else 'fp32'} x{n:g} ({kib:g} KiB)")
    parts += [f"{k} {counts.get(k, 0):g}" for k in ("local ops", "DTensor dispatches", "copies")]
    return "; ".join(parts)


def _table(rows: dict[str, dict[int, dict[str, Any]]]) -> None:
    for variant, by_layers in rows.items():
        a, b = by_layers[2], by_layers[4]
        saved = (b["saved_bytes"] - a["saved_bytes"]) / 2 / 2**20
        print(f"== {variant}: per layer and rest (embedding, head, loss, optimizer); saved for backward per layer "
              f"{saved:.2f} MiB; collectives: kind dtype xcount (bytes of the unsharded tensors)")  # fmt: skip
        for phase in PHASES:
            keys = set(a[phase]) | set(b[phase])
            per = {k: (b[phase].get(k, 0) - a[phase].get(k, 0)) / 2 for k in keys}
            print(f"  {phase:10s} per layer: {_line(per)}")
            print(f"  {'':10s} rest:      {_line({k: a[phase].get(k, 0) - 2 * per[k] for k in keys})}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["tp2", "lightning-tp2"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model-overrides", default="{}", help="JSON merged into the scaled-down shape")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="llmopt-audit-tp-"))
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for variant in args.variants:
        for layers in (2, 4):
            out = tmp / f"{variant}-{layers}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   __file__, "--worker", "--variant", variant, "--layers", str(layers), "--seq-len",
                   str(args.seq_len), "--model-overrides", args.model_overrides, "--out", str(out)]  # fmt: skip
            proc = subprocess.run(cmd, env=launch.child_env(args.nproc), capture_output=True, text=True)
            if not out.exists():
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                raise SystemExit(f"{variant} with {layers} layers failed (exit code {proc.returncode})")
            rows.setdefault(variant, {})[layers] = json.loads(out.read_text())
    _table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
