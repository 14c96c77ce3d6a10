"""Where documents come from: the default corpus (the Python standard library's own source) and user paths.

The default corpus needs no download and is identical on every machine running the same Python version, which makes
it a reproducible smoke-test corpus for language-model training.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Directories skipped when collecting the standard library: test suites (large, repetitive, full of odd encodings),
# vendored or third-party code, and byte-code caches.
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"})
TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIX = ".jsonl"


def _sorted_files(root: Path, suffixes: tuple[str, ...], excluded_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by their POSIX path relative to ``root``.

    Directories named in ``excluded_dirs`` are pruned without being walked (``site-packages`` can be huge).
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(suffixes))
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def default_corpus_files(max_bytes: int | None = None) -> list[Path]:
    """The ``.py`` files of the running Python's standard library, in a fixed order.

    Test suites and third-party folders (see ``EXCLUDED_DIRS``) are skipped. Files are sorted by their path relative
    to the standard-library root, so the list depends only on the Python version, not on the machine.

    Arguments:
        max_bytes: stop once the files collected so far hold at least this many bytes (``None``: take all).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes ({max_bytes}) must be positive or None")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {str(root)!r} (from sysconfig) does not exist")
    files: list[Path] = []
    total = 0
    for path in _sorted_files(root, (".py",), EXCLUDED_DIRS):
        if max_bytes is not None and total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def _read_jsonl(path: Path, key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{str(path)!r} line {line_no} is not valid JSON: {err}") from err
            if not isinstance(record, dict) or key not in record:
                raise ValueError(f"{str(path)!r} line {line_no} has no {key!r} field (set jsonl_key to the text field)")
            text = record[key]
            if not isinstance(text, str):
                raise ValueError(f"{str(path)!r} line {line_no}: field {key!r} is {type(text).__name__}, not str")
            if text.strip():
                yield text


def _read_file(path: Path, jsonl_key: str) -> Iterator[str]:
    if path.suffix == JSONL_SUFFIX:
        yield from _read_jsonl(path, jsonl_key)
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.strip():
        yield text


def read_documents(path: str | Path, jsonl_key: str = "text") -> Iterator[str]:
    """Yields the documents under a user path.

    * a ``.txt``, ``.md`` or ``.py`` file is one document;
    * a ``.jsonl`` file holds one document per line, in the field ``jsonl_key``;
    * a directory is searched recursively for such files, in sorted order.

    Whitespace-only documents are skipped. Text files are decoded as UTF-8 with invalid bytes replaced.

    Raises:
        FileNotFoundError: ``path`` does not exist (raised at call time, before iteration).
        ValueError: ``path`` is a file of another type, or yields no documents (raised during iteration).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    suffixes = (*TEXT_SUFFIXES, JSONL_SUFFIX)
    if path.is_dir():
        files = _sorted_files(path, suffixes)
    elif path.suffix in suffixes:
        files = [path]
    else:
        raise ValueError(f"data path {str(path)!r} has suffix {path.suffix!r}; expected one of {suffixes}")
    return _iter_documents(path, files, jsonl_key)


def _iter_documents(path: Path, files: list[Path], jsonl_key: str) -> Iterator[str]:
    count = 0
    for file in files:
        for doc in _read_file(file, jsonl_key):
            count += 1
            yield doc
    if count == 0:
        raise ValueError(f"data path {str(path)!r} holds no non-empty documents (looked for .txt, .md, .py, .jsonl)")
