"""``llmopt --help`` and the subcommands outside LightningCLI import neither Lightning nor the training stack.

Each check runs in a fresh interpreter (this one has imported everything already) and reads its ``sys.modules``;
start-up times are measured by ``benchmarks/bench_cli_startup.py``, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Lightning, and our modules that import it (the LightningModule, the strategies, the callbacks, the data module)
TRAINING = (
    "lightning",
    "lightning.pytorch",
    "lightning.fabric",
    "torchmetrics",
    "lightning_llmopt.module",
    "lightning_llmopt.strategies",
    "lightning_llmopt.callbacks",
    "lightning_llmopt.data.datamodule",
    "lightning_llmopt.cli.fit",
)

CHILD = """
import contextlib, io, json, sys
from lightning_llmopt.cli.main import main
heavy = json.loads(sys.argv[1])
seen = {}
for argv in json.loads(sys.argv[2]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    seen[" ".join(argv)] = {"loaded": sorted(m for m in heavy if m in sys.modules), "help": len(out.getvalue())}
print("SEEN " + json.dumps(seen))
"""


def _run_child(argvs: list[list[str]], heavy: tuple[str, ...]) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(heavy), json.dumps(argvs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SEEN "))
    return json.loads(line.removeprefix("SEEN "))


def test_help_and_subcommand_help_import_no_training_stack():
    """``llmopt --help`` imports not even torch; every plain subcommand's ``--help`` imports no Lightning (one child
    runs them in turn, each check sees what the commands so far have loaded)."""
    from lightning_llmopt.cli.main import _SUBCOMMANDS

    argvs = [["--help"], ["generate", "--help"], *[[name, "--help"] for name in _SUBCOMMANDS if name != "generate"]]
    seen = _run_child(argvs, (*TRAINING, "torch"))
    assert seen["--help"] == {"loaded": [], "help": seen["--help"]["help"]} and seen["--help"]["help"] > 0
    for argv in argvs[1:]:
        key = " ".join(argv)
        assert seen[key]["help"] > 0, key  # the subcommand printed its usage
        assert seen[key]["loaded"] in ([], ["torch"]), (key, seen[key])


def test_old_names_of_cli_main_still_resolve():
    """The LightningCLI subclass and its helpers moved to ``cli/fit.py`` (which ``llmopt fit`` imports; the in-process
    tests of test_cli.py run it); ``cli.main`` still hands them out."""
    from lightning_llmopt.cli import fit
    from lightning_llmopt.cli.main import LLMOptCLI, default_loggers, wandb_api_key_configured

    assert (LLMOptCLI, default_loggers, wandb_api_key_configured) == (
        fit.LLMOptCLI,
        fit.default_loggers,
        fit.wandb_api_key_configured,
    )
