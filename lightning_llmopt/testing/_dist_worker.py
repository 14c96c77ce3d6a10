"""Worker side of :mod:`lightning_llmopt.testing.distributed`: errors, sending functions by path, the task loop."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import pickle
import sys
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_REMOTE_PREFIX = "_llmopt_remote_"
_STOP = b"stop"  # never a pickle: those start with the PROTO opcode 0x80


class DistributedTaskError(RuntimeError):
    """A task raised on one or more ranks.

    Arguments:
        errors: ``{rank: formatted remote traceback}`` for every rank that raised.
        fn_name: the task's qualified name.
        stuck: ranks that had not finished when the error grace period ran out (the workers were then killed).
    """

    def __init__(self, errors: dict[int, str], fn_name: str, stuck: list[int] | None = None) -> None:
        self.errors = dict(sorted(errors.items()))
        self.rank = next(iter(self.errors))
        self.remote_traceback = self.errors[self.rank]
        self.stuck = list(stuck or [])
        ranks = ", ".join(str(r) for r in self.errors)
        parts = [f"{fn_name} failed on rank(s) {ranks}."]
        if self.stuck:
            parts[0] += (
                f" Ranks {self.stuck} were still running (likely waiting in a collective the failed rank never "
                "joined) and were killed; the pool restarts on the next run()."
            )
        for rank, tb in self.errors.items():
            parts.append(f"\n--- remote traceback, rank {rank} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


class DistributedTimeoutError(TimeoutError):
    """A task did not finish within the pool's timeout, or a worker died; the workers were killed."""


# --------------------------------------------------------------------------- sending functions by reference


_importable_cache: dict[str, bool] = {}
_path_modules: dict[str, types.ModuleType] = {}


def _module_importable(module_name: str) -> bool:
    """Whether ``import module_name`` in a fresh process finds the same file as the one loaded here."""
    if module_name in _importable_cache:
        return _importable_cache[module_name]
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module_name in ("__main__", "__mp_main__") or module_name.startswith(_REMOTE_PREFIX):
        ok = False
    elif file is None:  # builtins and extension-less modules are pickled by name
        ok = True
    else:
        spec = _find_spec_fresh(module_name)
        ok = spec is not None and spec.origin is not None and os.path.realpath(spec.origin) == os.path.realpath(file)
    _importable_cache[module_name] = ok
    return ok


def _find_spec_fresh(module_name: str) -> Any:
    """The spec a fresh interpreter would find for ``module_name``, ignoring ``sys.modules`` and importing nothing.

    (``importlib.util.find_spec`` returns ``sys.modules[name].__spec__`` for loaded modules, which says nothing about
    whether a worker can import the name.)
    """
    parts = module_name.split(".")
    search_path: Any = None
    spec: Any = None
    for i in range(len(parts)):
        fullname = ".".join(parts[: i + 1])
        spec = None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            try:
                spec = find_spec(fullname, search_path)
            except Exception:
                spec = None
            if spec is not None:
                break
        if spec is None:
            return None
        search_path = spec.submodule_search_locations
        if search_path is None and i < len(parts) - 1:
            return None
    return spec


def _module_from_path(path: str) -> types.ModuleType:
    """The module for source file ``path``: one already loaded here (pytest's copy), else a cached fresh load."""
    path = os.path.realpath(path)
    cached = _path_modules.get(path)
    if cached is not None:
        return cached
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file is not None and os.path.realpath(file) == path:
            _path_modules[path] = module
            return module
    name = _REMOTE_PREFIX + hashlib.sha1(path.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a module from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so dataclasses and pickling inside the module resolve it
    _path_modules[path] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name], _path_modules[path]
        raise
    return module


def _load_by_path(path: str, qualname: str) -> Any:
    obj: Any = _module_from_path(path)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles functions and classes of non-importable modules as ``(source path, qualified name)``."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, (types.FunctionType, type)):
            return NotImplemented
        module_name = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", "")
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise pickle.PicklingError(
                f"{module_name}.{qualname} cannot be sent to worker processes: define it at module level of a file"
            )
        registered = _lookup(sys.modules.get(module_name), qualname) is obj if module_name else True
        if module_name is None or (registered and _module_importable(module_name)):
            return NotImplemented
        # Not the object registered under its module's name (a second copy of a file loaded by path, e.g. one
        # helper module exec'd by two test files): send it by its own source file.
        file = getattr(sys.modules.get(module_name), "__file__", None) if registered else _source_file(obj)
        if file is None:
            raise pickle.PicklingError(f"{module_name}.{qualname} cannot be sent: its module has no source file")
        return _load_by_path, (os.path.realpath(file), qualname)


def _lookup(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _source_file(obj: Any) -> str | None:
    code = getattr(obj, "__code__", None)
    if code is not None:
        return str(code.co_filename)
    try:
        import inspect

        return inspect.getfile(obj)
    except (TypeError, OSError):
        return None


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- worker side


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    conn: Any,
    timeout_s: float,
    num_threads: int | None,
    environ: dict[str, str],
) -> None:
    """Entry point of one worker: join the process group once, then serve tasks until told to stop."""
    os.environ.clear()  # the parent's environment at pool start (a forkserver holds its own, older one)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    conn.send_bytes(_dumps(("final", "ready", os.getpid())))
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:  # parent went away
                break
            if message == _STOP:
                break
            _run_task(message, dist, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_task(task: bytes, dist: Any, conn: Any) -> None:
    """Run one task. Messages to the parent: ``("early", "error", tb)`` as soon as the function raised (before the
    barrier, where a failed rank may hang if others wait in a collective it skipped), then
    ``("final", status, value)`` after the barrier."""
    try:
        fn, args, kwargs = pickle.loads(task)
        outcome: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException:  # noqa: B036 - report everything to the parent, including KeyboardInterrupt/SystemExit
        outcome = ("error", traceback.format_exc())
        conn.send_bytes(_dumps(("early", *outcome)))
    try:
        dist.barrier()  # a rank that finished early must not start the next task while others still run this one
    except Exception:
        if outcome[0] == "ok":
            outcome = ("error", "barrier after the task failed:\n" + traceback.format_exc())
    try:
        message = _dumps(("final", *outcome))
    except Exception:
        message = _dumps(("final", "error", "could not pickle the result:\n" + traceback.format_exc()))
    conn.send_bytes(message)


# --------------------------------------------------------------------------- parent side
