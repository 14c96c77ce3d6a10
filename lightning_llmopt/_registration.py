"""Register our strategies in Lightning's ``StrategyRegistry`` without importing Lightning ourselves.

``import lightning_llmopt`` must leave ``lightning.pytorch`` unimported (it costs seconds, and ``llmopt generate``,
``serve`` or ``quantize`` never need it), yet ``import lightning_llmopt`` followed by ``Trainer(strategy="zero3")``
must keep working, whichever of the two packages was imported first. :func:`register_when_lightning_loads` does:

1. ``lightning.pytorch`` already imported: import :mod:`lightning_llmopt.strategies` (which registers) at once;
2. otherwise put a finder at the front of ``sys.meta_path``. It answers no import itself: for ``lightning`` and
   ``lightning.pytorch`` it asks the finders behind it for the real spec and wraps only its loader, so that when the
   module's own code has finished it imports :mod:`lightning_llmopt.strategies` and takes itself off
   ``sys.meta_path``. Registration waits for the outermost of the two: ``import lightning`` runs
   ``lightning.pytorch`` inside its own ``__init__``, when ``lightning.Trainer`` and friends do not exist yet.

The wrapped loader puts the real one back into ``module.__loader__`` and ``module.__spec__.loader`` before the
module's code runs, so nothing else (resources, ``inspect``, reloads) ever sees the wrapper. Should our strategies
fail to import, Lightning still loads, with a ``RuntimeWarning`` naming the error.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

STRATEGIES = "lightning_llmopt.strategies"
_WATCHED = ("lightning", "lightning.pytorch")


def register_when_lightning_loads() -> None:
    """Import :mod:`lightning_llmopt.strategies` now if ``lightning.pytorch`` is loaded, else right after it loads."""
    if "lightning.pytorch" in sys.modules:
        importlib.import_module(STRATEGIES)
    elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of ``lightning`` and ``lightning.pytorch`` (see the module docstring)."""

    def __init__(self) -> None:
        self._running: set[str] = set()  # watched modules whose code is executing now
        self._lock = threading.Lock()
        self._done = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _WATCHED or self._done:
            return None
        for finder in sys.meta_path:  # the spec the import would get without us
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # a namespace package or a legacy loader: leave it alone
        spec.loader = _ThenRegister(spec.loader, self)
        return spec

    def before(self, name: str) -> None:
        with self._lock:
            self._running.add(name)

    def after(self, name: str, ok: bool) -> None:
        with self._lock:
            self._running.discard(name)
            if not ok or self._done or "lightning" in self._running or "lightning.pytorch" not in sys.modules:
                return  # `lightning` is still running its __init__, or only `lightning` itself loaded so far
            self._done = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            importlib.import_module(STRATEGIES)
        except Exception as exc:  # Lightning itself loaded fine: keep it importable, say why our names are missing
            warnings.warn(
                f"lightning_llmopt could not register its strategies: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )


class _ThenRegister(importlib.abc.Loader):
    """The real loader, then :meth:`_RegisterAfterLightning.after` once the module's code has run."""

    def __init__(self, loader: importlib.abc.Loader, hook: _RegisterAfterLightning) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None and module.__spec__.loader is self:
            module.__spec__.loader = self.loader
        self.hook.before(module.__name__)
        try:
            self.loader.exec_module(module)
        except BaseException:
            self.hook.after(module.__name__, ok=False)
            raise
        self.hook.after(module.__name__, ok=True)
