"""Kernel choices kept on disk, so a warm start skips the tuning a cold one does.

What the engine tunes per shape, and where it is kept:

- :class:`~lightning_llmopt.inference.linear_chooser.LinearChooser`: cuBLAS or a Triton GEMV (fused or not) per
  weight shape, dtype and row bucket (namespace ``"linear"``);
- :func:`~lightning_llmopt.kernels.quant_matmul_tune.choose_config`: the launch configuration of a quantized
  matmul per M bucket, N, K, bits, group, zero points and dtype (namespace ``"quant_matmul"``);
- ``triton.autotune`` searches (the GEMVs, paged and flash attention): Triton's own disk cache, switched on here
  (``triton.knobs.autotuning.cache``); it lives in Triton's cache folder (``TRITON_CACHE_DIR``, default
  ``~/.triton/cache``) and is keyed by the Triton version and source hash, the GPU target, the kernel's source, the
  tuning key and the candidate configurations.

The first two live in one JSON file per *environment*: ``<dir>/<hash>.json`` where the hash is that of the
fingerprint (:func:`environment`: GPU name and compute capability, torch, CUDA, Triton and package versions, a hash
of the sources of the kernels timed and of the timing code, and the environment variables that change a decision).
Each entry's key holds the shape, dtype and quantization. ``<dir>`` is ``$LLMOPT_CACHE_DIR/tuning``, else
``$XDG_CACHE_HOME/lightning_llmopt/tuning``, else ``~/.cache/lightning_llmopt/tuning``; ``LLMOPT_TUNING_CACHE=0``
(or ``EngineConfig(tuning_cache=False)``) turns the cache off. Writes go to a temporary file in the same folder,
then ``os.replace``: a crash leaves the old file or the new one, never half of one. A file that does not parse, or
whose fingerprint is not this environment's (copied from another machine), is ignored with a warning and rewritten
at the next decision.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "TuningCache", "default_cache_dir", "encode_key", "environment"]

FORMAT = 1  # bump when the meaning of a stored value changes
_ENV_VARS = ("LLMOPT_PDL", "LLMOPT_QUANT_TUNE")  # they change what a decision would be


def default_cache_dir() -> Path:
    """``$LLMOPT_CACHE_DIR/tuning``, else ``$XDG_CACHE_HOME/lightning_llmopt/tuning``, else
    ``~/.cache/lightning_llmopt/tuning``."""
    root = os.environ.get("LLMOPT_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "tuning"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lightning_llmopt" / "tuning"


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict[str, Any]:
    """What invalidates every stored decision: the device (GPU name and compute capability), the torch, CUDA, Triton
    and ``lightning_llmopt`` versions, the cache format, the environment variables that steer a decision, and a hash
    of the kernels' and the tuners' sources (a development tree keeps its version while they change)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        capability: str | None = "{}.{}".format(*torch.cuda.get_device_capability(index))
    else:
        name, capability = device.type, None
    return {
        "format": FORMAT,
        "device": name,
        "capability": capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "lightning_llmopt": _package_version(),
        "env": {k: os.environ.get(k) for k in _ENV_VARS},
        "code": _code_hash(),
    }


# the sources whose change can change a decision (the kernels timed, and how they are timed): a development tree
# keeps its version number while they change
_TUNED_SOURCES = (
    "inference/gemv.py",
    "inference/linear_chooser.py",
    "inference/decode_kernels.py",
    "kernels/quant_matmul_fwd.py",
    "kernels/quant_matmul_tune.py",
)


def _code_hash() -> str:
    import lightning_llmopt

    root = Path(lightning_llmopt.__file__).parent
    digest = hashlib.sha256()
    for rel in _TUNED_SOURCES:
        path = root / rel
        digest.update(rel.encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]


def _package_version() -> str | None:
    import lightning_llmopt

    return getattr(lightning_llmopt, "__version__", None) or _version("lightning_llmopt")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise TypeError(f"a tuning key holds {type(value).__name__} ({value!r}); use str, int, float, bool or dtypes")


def encode_key(key: tuple) -> str:
    """A decision's key (a tuple of shapes, dtypes, flags) as the JSON text it is stored under."""
    return json.dumps(_plain(key), separators=(",", ":"))


class TuningCache:
    """One environment's stored decisions (see the module docstring).

    Arguments:
        device: the device the decisions are for (its name and capability are in the fingerprint).
        directory: where the files live (default :func:`default_cache_dir`).
        enabled: ``False`` keeps nothing (every lookup misses, nothing is written); default: on unless
            ``LLMOPT_TUNING_CACHE=0``.
    """

    def __init__(
        self, device: torch.device | str, directory: str | Path | None = None, enabled: bool | None = None
    ) -> None:
        if enabled is None:
            enabled = os.environ.get("LLMOPT_TUNING_CACHE", "1") != "0"
        self.enabled = enabled
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.fingerprint = environment(device)
        digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.directory / f"{digest}.json"
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = self._read() if enabled else {}

    def __repr__(self) -> str:
        state = str(self.path) if self.enabled else "disabled"
        return f"TuningCache({state}, {sum(len(v) for v in self._entries.values())} entries)"

    def _read(self) -> dict[str, dict[str, Any]]:
        """The file's entries; ``{}`` (with a warning) when it is missing, corrupt or another environment's."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            warnings.warn(f"tuning cache {self.path} unreadable ({exc}); tuning again", stacklevel=3)
            return {}
        try:
            data = json.loads(text)
            ok = isinstance(data, dict) and isinstance(data.get("entries"), dict)
            ok = ok and all(isinstance(v, dict) for v in data["entries"].values())
        except ValueError:
            ok = False
        if not ok:
            warnings.warn(f"tuning cache {self.path} is corrupt; ignoring it and tuning again", stacklevel=3)
            return {}
        if data.get("fingerprint") != self.fingerprint:
            warnings.warn(
                f"tuning cache {self.path} belongs to another environment ({data.get('fingerprint')!r}, this one is "
                f"{self.fingerprint!r}); ignoring it and tuning again",
                stacklevel=3,
            )
            return {}
        return data["entries"]

    def get(self, namespace: str, key: tuple) -> Any:
        """The stored value of ``key`` in ``namespace``, or ``None``."""
        if not self.enabled:
            return None
        value = self._entries.get(namespace, {}).get(encode_key(key))
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, namespace: str, key: tuple, value: Any) -> None:
        """Store a decision (a JSON value) and write the file atomically, merged with what is on disk by now (another
        process may have added entries meanwhile)."""
        if not self.enabled:
            return
        with self._lock:
            self._entries.setdefault(namespace, {})[encode_key(key)] = value
            self._write()

    def _write(self) -> None:
        on_disk = self._read_quietly()
        for ns, entries in self._entries.items():
            on_disk.setdefault(ns, {}).update(entries)
        self._entries = on_disk
        body = json.dumps({"fingerprint": self.fingerprint, "entries": on_disk}, indent=1, sort_keys=True)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}-", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:  # a read-only home must not stop serving
            warnings.warn(f"could not write the tuning cache {self.path} ({exc})", stacklevel=3)
            return
        self.writes += 1

    def _read_quietly(self) -> dict[str, dict[str, Any]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._read()


def enable_triton_autotune_cache() -> None:
    """Turn on Triton's own disk cache of ``triton.autotune`` results (for autotuners created from now on)."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs: nothing to keep
        return
    autotuning = getattr(knobs, "autotuning", None)
    if autotuning is not None and hasattr(type(autotuning), "cache"):  # feature-detected (triton >= 3.4 has it)
        autotuning.cache = True


def attach(
    setting: bool | str | Path | TuningCache | None,
    runner: Any,
    device: torch.device,
    startup: Any = None,
    shared_counters: bool = True,
) -> TuningCache | None:
    """Open the cache ``setting`` names (``True``/``None``: :func:`default_cache_dir`; a path: that folder;
    ``False``: none) and hand it to what tunes: the runner's :class:`~.linear_chooser.LinearChooser`, the quantized
    matmul's search (CUDA), and Triton's autotuner (its own disk cache, CUDA). ``startup`` (a
    :class:`~.startup.StartupLog`) then counts the decisions timed, the searches run and the cache hits per phase
    (``shared_counters=False``: only the runner's own decisions, for a second runner over the same cache)."""
    from lightning_llmopt.kernels import precompile  # imports no Triton

    quant_matmul_tune: Any = None
    # the quantized matmul's search runs on CUDA with Triton only; elsewhere importing it would only import Triton
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from lightning_llmopt.kernels import quant_matmul_tune

    cache = None
    if isinstance(setting, TuningCache):
        cache = setting if setting.enabled else None
    elif setting is not False:
        directory = None if setting in (True, None) else Path(str(setting))
        cache = TuningCache(device, directory)
        if not cache.enabled:
            cache = None
    chooser = getattr(runner, "linear", None)
    if chooser is not None:
        chooser.store = cache
    if device.type == "cuda" and cache is not None and quant_matmul_tune is not None:
        quant_matmul_tune.set_store(cache)
        enable_triton_autotune_cache()
    if startup is not None:

        def counters() -> dict[str, float]:
            out: dict[str, float] = {}
            if chooser is not None:
                out.update(linear_tunings=float(chooser.tunings), linear_tuning_s=chooser.tuning_s)
            if shared_counters and quant_matmul_tune is not None:
                out["quant_tunings"] = float(quant_matmul_tune.TUNE_STATS["tunings"])
                out["quant_tuning_s"] = float(quant_matmul_tune.TUNE_STATS["seconds"])
            if shared_counters and cache is not None:
                out["tuning_cache_hits"] = float(cache.hits)
            if shared_counters:  # candidates compiled on threads before a search timed them (kernels/precompile.py)
                out["parallel_compiles"] = float(precompile.STATS["calls"])
                out["parallel_compile_s"] = float(precompile.STATS["seconds"])
            return out

        startup.add_source(counters)
    return cache
