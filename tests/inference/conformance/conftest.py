"""Fixtures of the OpenAI conformance suite: one server per test module (``served_url``) and the official ``openai``
client on it (``client``).

A module that needs another server (other options, another model) overrides ``served_url`` with its own
module-scoped fixture, built with the helpers of ``_conformance_server.py`` (``import _conformance_server``);
``client`` then talks to that server.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# tests/ is not a package (--import-mode=importlib): the helpers are loaded by path, once, under a unique name
_NAME = "_conformance_server"
_spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name(f"{_NAME}.py"))
assert _spec is not None and _spec.loader is not None
if _NAME not in sys.modules:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    sys.modules[_NAME] = _module
helpers = sys.modules[_NAME]


@pytest.fixture(scope="module")
def served_url() -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of a server over the tiny model, named ``"tiny"``, no API key."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with helpers.running(helpers.tiny_server()) as url:
        yield url


@pytest.fixture(scope="module")
def client(served_url: str) -> Iterator[Any]:
    """``openai.OpenAI`` on ``served_url`` (no retries: an error surfaces at once; proxies from the environment
    ignored)."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    with openai.OpenAI(base_url=f"{served_url}/v1", api_key="none", max_retries=0, timeout=60,
                       http_client=httpx.Client(trust_env=False)) as c:  # fmt: skip
        yield c
