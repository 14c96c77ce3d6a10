"""Print one of the README's two set-up commands, so that CI runs exactly what the README says.

``python3 .ci/readme_command.py tests`` prints the command of the "Run the tests" block, ``main`` that of the block
after "Train the"; each is the first ```bash block after its heading line.
"""

from __future__ import annotations

import pathlib
import sys

LEADS = {"tests": "Run the tests", "main": "Train the"}


def command(which: str) -> str:
    lines = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(LEADS[which]))
    fence = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
    body = [line for line in lines[fence + 1 : end] if line.strip()]
    if len(body) != 1:
        raise SystemExit(f"README: the {which!r} block must hold one command line, found {len(body)}")
    return body[0]


if __name__ == "__main__":
    print(command(sys.argv[1] if len(sys.argv) > 1 else "tests"))
