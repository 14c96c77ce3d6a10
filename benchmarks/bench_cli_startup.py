"""How long ``llmopt`` takes to start, this tree against an earlier one (issue 52, item 4: a CLI that starts in ~1 s).

Every figure is the wall time of a fresh process, from its start to the end named below, with ``PYTHONPATH``
pointing at the tree measured and a scratch folder as the working directory (so ``''`` on ``sys.path`` finds no
other copy of the package):

- ``import_s``: ``python -c "import lightning_llmopt"``;
- ``help_s``: ``llmopt --help`` (``python -m lightning_llmopt.cli --help``, what the console script runs);
- ``generate_help_s``: ``llmopt generate --help``;
- ``generate_s``: ``llmopt generate --preset tiny --tokenizer byte --prompt hi --max-tokens 8 --device cpu``, to exit;
- ``pipeline_plan_s``: ``llmopt pipeline-plan --pp 4 --microbatches 8``, to exit;
- ``serve_health_s`` / ``serve_completion_s``: ``llmopt serve --preset tiny --tokenizer byte --device cpu``, to the
  first 200 on ``/health`` / to the end of the first ``/v1/completions`` answer (8 tokens, greedy) after it;
  ``serve_engine_ready_s`` is the engine build the server itself reports (``engine ready in X s``).

Each ``*_cpu_s`` beside a figure is the CPU time (user + system) the process had used by then: on a machine shared
with other jobs the wall times stretch with the load, the CPU times much less, so they show what an idle machine
would take (for these mostly single-threaded start-ups).

The trees run in turns within each round, the earlier one first in even rounds and last in odd ones, so that a
change in the machine's load falls on both; each figure is the median over ``--repeats`` rounds. The earlier tree
(``--peer-tree``, e.g. ``git worktree add /tmp/base <commit>``) is the peer. Whether each command imported
``lightning.pytorch`` is checked once per tree in a separate, untimed process.

Usage: ``python benchmarks/bench_cli_startup.py --peer-tree /tmp/base --peer-label 3c50fe9`` (records in
benchmarks/results/); ``--smoke`` runs one round with this tree as its own peer (records in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package

import records  # noqa: E402

CLI = ["-m", "lightning_llmopt.cli"]
GENERATE = ["generate", "--preset", "tiny", "--tokenizer", "byte", "--prompt", "hi", "--max-tokens", "8",
            "--ignore-eos", "--device", "cpu", "--num-blocks", "16", "--quiet"]  # fmt: skip
COMMANDS: dict[str, list[str]] = {
    "import_s": ["-c", "import lightning_llmopt"],
    "help_s": [*CLI, "--help"],
    "generate_help_s": [*CLI, "generate", "--help"],
    "generate_s": [*CLI, *GENERATE],
    "pipeline_plan_s": [*CLI, "pipeline-plan", "--pp", "4", "--microbatches", "8"],
}
SERVE = ["serve", "--preset", "tiny", "--tokenizer", "byte", "--device", "cpu", "--num-blocks", "64",
         "--log-level", "warning"]  # fmt: skip
# the same commands, in one untimed process each, reporting whether lightning.pytorch was imported
CHECK = """
import runpy, sys
argv = sys.argv[1:]
if argv[:1] == ["-c"]:
    exec(argv[1])
else:
    sys.argv = ["llmopt", *argv[2:]]
    try:
        runpy.run_module("lightning_llmopt.cli", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
print("LIGHTNING", "lightning.pytorch" in sys.modules, file=sys.stderr)
"""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def _env(tree: Path, scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    caches = scratch / f"caches-{abs(hash(str(tree))):x}"  # each tree its own tuning and Triton caches
    env.update(PYTHONPATH=str(tree), LLMOPT_CACHE_DIR=str(caches / "llmopt"), TRITON_CACHE_DIR=str(caches / "triton"))
    return env


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_command(tree: Path, scratch: Path, args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``python ARGS``, start to exit (a non-zero exit raises with its stderr)."""
    cpu = _children_cpu()
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *args], cwd=scratch, env=_env(tree, scratch), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    elapsed = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed (exit {out.returncode}) in {tree}: {out.stderr[-2000:]}")
    return elapsed, _children_cpu() - cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def time_serve(tree: Path, scratch: Path) -> dict[str, float]:
    """Seconds from the server's start to its first 200 on /health and to the end of its first completion."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (scratch / "serve.log").open("w+")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *CLI, *SERVE, "--port", str(port)], cwd=scratch,
                            env=_env(tree, scratch), stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > 600:
                log.seek(0)
                raise RuntimeError(f"the server exited or never answered ({proc.returncode}): {log.read()[-2000:]}")
            try:
                if _request(f"{url}/health")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.01)
        health, health_cpu = time.perf_counter() - start, _process_cpu(proc.pid)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        status, text = _request(f"{url}/v1/completions", body)
        completion, completion_cpu = time.perf_counter() - start, _process_cpu(proc.pid)
        if status != 200 or json.loads(text)["usage"]["completion_tokens"] != 8:
            raise RuntimeError(f"the completion failed ({status}): {text[:500]!r}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.seek(0)
    ready = re.search(r"engine ready in ([0-9.]+) s", log.read())
    log.close()
    return {"serve_health_s": health, "serve_completion_s": completion, "serve_health_cpu_s": health_cpu,
            "serve_completion_cpu_s": completion_cpu,
            "serve_engine_ready_s": float(ready.group(1)) if ready else float("nan")}  # fmt: skip


def imports_lightning(tree: Path, scratch: Path) -> dict[str, bool]:
    """Per command: whether it imported ``lightning.pytorch`` (one untimed process each)."""
    seen = {}
    for metric, args in COMMANDS.items():
        out = subprocess.run([sys.executable, "-c", CHECK, *args], cwd=scratch, env=_env(tree, scratch),
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        line = next((ln for ln in out.stderr.splitlines() if ln.startswith("LIGHTNING ")), "LIGHTNING ?")
        seen[metric.removesuffix("_s")] = line.split()[1] == "True"
    return seen


def one_round(tree: Path, scratch: Path) -> dict[str, float]:
    row = {}
    for metric, args in COMMANDS.items():
        row[metric], row[metric.removesuffix("_s") + "_cpu_s"] = time_command(tree, scratch, args)
    row.update(time_serve(tree, scratch))
    print(json.dumps({"tree": str(tree), **{k: round(v, 3) for k, v in row.items()}}), flush=True)
    return row


def _label(tree: Path, given: str | None) -> str:
    if given:
        return given
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or str(tree)


def run(peer_tree: Path, peer_label: str | None, repeats: int) -> dict[str, Any]:
    ours_tree = records.REPO_ROOT
    scratch = Path(tempfile.mkdtemp(prefix="llmopt-cli-startup-"))
    trees = {"ours": ours_tree, "peer": peer_tree}
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "peer": []}
    for r in range(repeats):
        for side in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
            runs[side].append(one_round(trees[side], scratch))
    load_end = os.getloadavg()
    rows = {}
    labels = {"ours": f"this tree ({_label(ours_tree, None)})", "peer": f"before ({_label(peer_tree, peer_label)})"}
    for side, label in labels.items():
        metrics = sorted(runs[side][0])
        rows[side] = {
            "variant": label,
            **{m: statistics.median(x[m] for x in runs[side]) for m in metrics},
            "range_s": {m.removesuffix("_s"): [round(min(x[m] for x in runs[side]), 2),
                                               round(max(x[m] for x in runs[side]), 2)]
                        for m in metrics if not m.endswith("_cpu_s")},
            "imports_lightning": imports_lightning(trees[side], scratch),
        }  # fmt: skip
    config = {
        "commands": {k: " ".join(v) for k, v in COMMANDS.items()} | {"serve": " ".join([*CLI, *SERVE])},
        "repeats": repeats,
        "machine": f"{os.cpu_count()} CPU cores shared with other jobs (load average {load_start[0]:.1f} at the "
        f"start, {load_end[0]:.1f} at the end)",
        "processes": "one fresh process per figure; the trees alternate within each round",
    }
    notes = [
        "every figure: median seconds over the rounds, from process start (range_s: fastest and slowest run); "
        "*_cpu_s: the process's CPU time (user + system) by then",
        "the peer is the same commands run against the tree before the change, in the same rounds",
        "goals (issue 52): llmopt --help <= 1.5 s; llmopt serve answering <= 3 s after start (tiny model, CPU)",
    ]
    record = records.make_record("cli-startup", config, [rows["ours"]], [rows["peer"]], benchmark="startup",
                                 ratio_metric="help_s", notes=notes)  # fmt: skip
    for metric in sorted(set(rows["ours"]) - {"help_s", "variant", "range_s", "imports_lightning"}):
        record["ratios"] += records.compute_ratios([rows["ours"]], [rows["peer"]], metric)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llmopt start-up times, this tree against an earlier one.")
    parser.add_argument("--peer-tree", type=Path, default=None, help="a checkout of the earlier commit")
    parser.add_argument("--peer-label", default=None, help="how to name it (default: its git commit)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one round, this tree as its own peer, temporary records")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.peer_tree, args.repeats = args.peer_tree or records.REPO_ROOT, 1
    elif args.peer_tree is None:
        parser.error("--peer-tree is required (a checkout of the commit to compare with), or --smoke")
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    record = run(args.peer_tree.resolve(), args.peer_label, args.repeats)
    path = records.write_record(record, results_dir)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
