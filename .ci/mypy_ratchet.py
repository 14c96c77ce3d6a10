"""mypy on the package, ratcheted: the modules listed in .ci/mypy-clean.txt must have no error, and the list only grows.

Runs mypy (the project's ``[tool.mypy]`` config) over the whole package once, then:

- fails if a listed module has an error (it was clean, keep it so);
- prints the modules that are clean but not listed yet: add them (``--update`` does);
- prints the package's error total, so the rest can be worked down.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIST = ROOT / ".ci" / "mypy-clean.txt"


def errors_by_file() -> dict[str, int]:
    run = subprocess.run([sys.executable, "-m", "mypy", "lightning_llmopt"], cwd=ROOT, capture_output=True, text=True)
    if run.returncode not in (0, 1) or "error: " not in run.stdout and run.returncode == 1:
        sys.exit(f"mypy did not run:\n{run.stdout}\n{run.stderr}")
    counts: dict[str, int] = {}
    for line in run.stdout.splitlines():
        match = re.match(r"^(lightning_llmopt/[^:]+\.py):\d+: error:", line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def main() -> int:
    counts = errors_by_file()
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_llmopt").rglob("*.py"))
    listed = [m for m in LIST.read_text().split() if m] if LIST.exists() else []
    clean = [m for m in modules if m not in counts]
    if "--update" in sys.argv:
        LIST.write_text("\n".join(sorted(set(listed) | set(clean))) + "\n")
        listed = sorted(set(listed) | set(clean))
    broken = [m for m in listed if counts.get(m)]
    missing = [m for m in listed if m not in modules]
    print(f"mypy: {sum(counts.values())} errors in {len(counts)} of {len(modules)} modules; "
          f"{len(listed)} modules held clean (.ci/mypy-clean.txt)")
    for m in sorted(set(clean) - set(listed)):
        print(f"  clean but not listed (add it): {m}")
    for m in broken:
        print(f"  listed module now has {counts[m]} mypy error(s): {m}")
    for m in missing:
        print(f"  listed module no longer exists (remove it from the list): {m}")
    return 1 if broken or missing else 0


if __name__ == "__main__":
    sys.exit(main())
