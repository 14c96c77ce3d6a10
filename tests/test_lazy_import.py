"""``import lightning_llmopt`` is lazy, and our strategies still register in Lightning, whichever comes first.

Each check runs in a fresh interpreter: this one imported Lightning and the package long ago. The order
``import lightning_llmopt`` then ``import lightning`` is also checked by
``tests/strategies/test_zero_strategy.py::test_package_import_registers``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HEAVY = ("torch", "lightning", "lightning.pytorch", "torchmetrics", "triton", "transformers", "wandb")


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_is_lazy_then_names_resolve_and_register():
    """Nothing heavy on import; names load on first access; loading ``models/llama.py`` registers the kernel step
    (``optimize``); our own first import of Lightning (``CausalLMModule`` imports it) registers the strategies; the
    import hooks leave ``sys.meta_path`` and Lightning's loaders as they were."""
    out = _python(f"""
import inspect, sys
import lightning_llmopt
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert heavy == [], heavy
assert {{"CausalLMModule", "Llama", "LlamaConfig", "TextDataModule", "TrainingMonitor"}} <= set(dir(lightning_llmopt))
hooks = sorted(f.target for f in sys.meta_path if type(f).__module__ == "lightning_llmopt._registration")
assert hooks == ["lightning.pytorch", "lightning_llmopt.models.llama"], sys.meta_path

import lightning_llmopt.parallel.parallelize  # binds the submodule to the package; the function must stay
from lightning_llmopt.parallel import parallelize, ring_attention
assert inspect.isfunction(parallelize) and inspect.isfunction(ring_attention)

model = lightning_llmopt.Llama(lightning_llmopt.LlamaConfig.from_preset("tiny"))
assert "lightning.pytorch" not in sys.modules
assert type(model).__module__ == "lightning_llmopt.models.llama" and "lightning_llmopt.optimize" in sys.modules
hooks = [f.target for f in sys.meta_path if type(f).__module__ == "lightning_llmopt._registration"]
assert hooks == ["lightning.pytorch"], hooks

module = lightning_llmopt.CausalLMModule
from lightning.pytorch.strategies import StrategyRegistry
ours = sorted(n for n in StrategyRegistry if StrategyRegistry[n]["strategy"].__module__.startswith("lightning_llmopt"))
print("OURS", *ours)
assert not [f for f in sys.meta_path if type(f).__module__ == "lightning_llmopt._registration"]
import lightning, lightning.pytorch
loaders = [type(m.__loader__).__name__ for m in (lightning, lightning.pytorch)]
assert loaders == [type(m.__spec__.loader).__name__ for m in (lightning, lightning.pytorch)] == ["SourceFileLoader"] * 2
assert module.__name__ == "CausalLMModule" and lightning_llmopt.TrainingMonitor.__name__ == "TrainingMonitor"
""")
    ours = next(ln for ln in out.splitlines() if ln.startswith("OURS")).split()[1:]
    assert {"zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "nd_parallel", "ssp"} <= set(ours)


def test_strategies_register_when_lightning_came_first():
    out = _python("""
import sys
import lightning as L
import lightning_llmopt
assert not [f for f in sys.meta_path if type(f).__module__ == "lightning_llmopt._registration"]
t = L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
print("STRATEGY", type(t.strategy).__name__, t.strategy.stage)
""")
    assert "STRATEGY ZeroStrategy 3" in out.splitlines()


def test_lightning_still_loads_when_our_strategies_cannot():
    """A failing import of our strategies must not break ``import lightning``: a warning names the error."""
    out = _python("""
import sys, warnings
import lightning_llmopt
sys.modules["lightning_llmopt.strategies"] = None  # makes importing it fail
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import lightning
assert lightning.Trainer is not None
print("WARNED", *[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
""")
    assert "WARNED lightning_llmopt could not register its strategies: ModuleNotFoundError" in out
