"""Registrations that ``import lightning_llmopt`` promises, made when what they register into is imported.

``import lightning_llmopt`` imports neither Lightning (seconds, and ``llmopt generate``, ``serve`` or ``quantize``
never need it) nor torch, yet two registrations must hold as if the package had imported everything:

- our strategies in Lightning's ``StrategyRegistry``, so ``Trainer(strategy="zero3")`` works whichever of the two
  packages was imported first: :func:`register_when_lightning_loads` imports :mod:`lightning_llmopt.strategies`;
- the construction-time kernel step of :class:`~lightning_llmopt.models.llama.Llama` (``config.fused_kernels``),
  which ``models/`` may not import from above: :func:`register_when_llama_loads` imports
  :mod:`lightning_llmopt.optimize`, which registers it.

Each imports its module at once if the target is already loaded, else puts an :class:`ImportAfter` finder at the
front of ``sys.meta_path``. The finder answers no import itself: for the modules it watches it asks the finders
behind it for the real spec and wraps only its loader, so that when the module's own code has finished it imports
the follow-up module and takes itself off ``sys.meta_path``. With an ``outer`` module it waits for that one too:
``import lightning`` runs ``lightning.pytorch`` inside its own ``__init__``, when ``lightning.Trainer`` and friends
do not exist yet.

The wrapped loader puts the real one back into ``module.__loader__`` and ``module.__spec__.loader`` before the
module's code runs, so nothing else (resources, ``inspect``, reloads) ever sees the wrapper. Should the follow-up
import fail, the watched module still loads, with a ``RuntimeWarning`` naming the error.
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
KERNEL_STEP = "lightning_llmopt.optimize"
LLAMA = "lightning_llmopt.models.llama"


def register_when_lightning_loads() -> None:
    """Import :mod:`lightning_llmopt.strategies` now if ``lightning.pytorch`` is loaded, else right after it loads."""
    import_after("lightning.pytorch", STRATEGIES, "register its strategies", outer="lightning")


def register_when_llama_loads() -> None:
    """Import :mod:`lightning_llmopt.optimize` (the kernel step) right after ``models/llama.py`` loads."""
    import_after(LLAMA, KERNEL_STEP, "register its kernel step")


def import_after(target: str, then: str, purpose: str, outer: str | None = None) -> None:
    """Import ``then`` now if ``target`` is loaded, else once ``target`` (and ``outer``, if it runs) has loaded."""
    if target in sys.modules:
        importlib.import_module(then)
    elif not any(isinstance(f, ImportAfter) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, ImportAfter(target, then, purpose, outer))


class ImportAfter(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of ``target`` and ``outer`` (see the module docstring).

    Arguments:
        target: the module whose loading triggers the import.
        then: the module to import then.
        purpose: what that import does, for the warning if it fails (``"register its strategies"``).
        outer: a module that imports ``target`` inside its own ``__init__``: wait until it has finished too.
    """

    def __init__(self, target: str, then: str, purpose: str, outer: str | None = None) -> None:
        self.target, self.then, self.purpose, self.outer = target, then, purpose, outer
        self._watched = {target} if outer is None else {target, outer}
        self._running: set[str] = set()  # watched modules whose code is executing now
        self._lock = threading.Lock()
        self._done = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self._watched or self._done:
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
        spec.loader = _ThenImport(spec.loader, self)
        return spec

    def before(self, name: str) -> None:
        with self._lock:
            self._running.add(name)

    def after(self, name: str, ok: bool) -> None:
        with self._lock:
            self._running.discard(name)
            if not ok or self._done or self.outer in self._running or self.target not in sys.modules:
                return  # the outer module is still running its __init__, or only the outer one loaded so far
            self._done = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            importlib.import_module(self.then)
        except Exception as exc:  # the watched module itself loaded fine: keep it importable, say what is missing
            warnings.warn(
                f"lightning_llmopt could not {self.purpose}: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2
            )


class _ThenImport(importlib.abc.Loader):
    """The real loader, then :meth:`ImportAfter.after` once the module's code has run."""

    def __init__(self, loader: importlib.abc.Loader, hook: ImportAfter) -> None:
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
