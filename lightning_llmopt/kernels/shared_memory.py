"""What a device can launch: its shared memory per block, and autotuning lists pruned by an analytic estimate.

A Triton configuration whose shared memory exceeds the device's opt-in limit per block compiles, then fails at
launch with ``OutOfResources`` (MLA prefill at head dim 192, padded to 256: the flash forward's ``(128, 64, 8, 3)``
needs 262144 bytes on an H100/H200, whose limit is 232448). Triton's autotuner times such a configuration as
``inf``, but only after compiling it, and a launcher that re-times candidates can still hit the error. So every
autotuned kernel of the package prunes, in its ``early_config_prune`` (or its own search), the configurations whose
estimate exceeds the limit, before anything is compiled or timed:

- :func:`device_limit`: the opt-in maximum per block (``torch.cuda.get_device_properties(i)
  .shared_memory_per_block_optin`` where this torch has it, else Triton's driver ``max_shared_mem``); ``None`` (no
  limit) on CPU and under the Triton interpreter;
- each kernel module defines its estimate beside the kernel (tile bytes times pipeline stages, the formula written
  there) and registers it in :data:`ESTIMATES` under the ``@triton.jit`` function's name, so that a GPU test can
  compare it with what Triton reports (``metadata.shared``) for every configuration of every table: the estimate
  must be an upper bound;
- :func:`fit` keeps the configurations that fit and raises :class:`SharedMemoryError`, naming the kernel, the call
  (head dim, dtype) and the smallest estimate against the limit, where none does.

:func:`searches` counts the prunes, one per autotuning search (Triton prunes once per new key, before its disk
cache): the engine's start-up log counts searches with it on Tritons without an autotuning listener (3.6).

This module imports no Triton at import time.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "ESTIMATES",
    "H100_LIMIT",
    "SharedMemoryError",
    "describe",
    "device_limit",
    "element_sizes",
    "first_device",
    "fit",
    "register",
    "searches",
]

H100_LIMIT = 232448  # opt-in shared memory per block of sm_90 (H100, H200): 227 KiB

C = TypeVar("C")

ESTIMATES: dict[str, Callable[[dict[str, Any]], int]] = {}
"""Shared-memory estimate (bytes) of each autotuned kernel, by ``@triton.jit`` function name. The argument holds the
kernel's constexprs (``BLOCK_M``, ``HEAD_D``, ...), ``num_warps``, ``num_stages`` and ``elem``: the element size in
bytes of each tensor argument, by parameter name."""

_searches = [0]
_lock = threading.Lock()


class SharedMemoryError(RuntimeError):
    """No configuration of a kernel's autotuning list fits the device's shared memory per block."""


def register(kernel_name: str) -> Callable[[Callable[[dict[str, Any]], int]], Callable[[dict[str, Any]], int]]:
    """Decorator: record ``estimate`` in :data:`ESTIMATES` under ``kernel_name``."""

    def wrap(estimate: Callable[[dict[str, Any]], int]) -> Callable[[dict[str, Any]], int]:
        ESTIMATES[kernel_name] = estimate
        return estimate

    return wrap


def device_limit(device: torch.device | str | int | None) -> int | None:
    """Opt-in shared memory per block (bytes) of a CUDA ``device``; ``None`` (no limit) for CPU tensors, under the
    Triton interpreter, or where neither torch nor Triton reports it."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return None
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_limit(index)


@functools.cache
def _cuda_limit(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.4 (feature-detected)
    if optin:
        return int(optin)
    try:  # Triton's driver: {"max_shared_mem": ...} on the NVIDIA and AMD backends
        from triton.runtime import driver

        value = driver.active.utils.get_device_properties(index).get("max_shared_mem")
    except Exception:  # noqa: BLE001 - any Triton without this private surface: no limit known
        return None
    return int(value) if value else None


def element_sizes(named_args: dict[str, Any]) -> dict[str, int]:
    """Element size in bytes of every tensor among an autotuner's ``named_args``."""
    return {k: v.element_size() for k, v in named_args.items() if isinstance(v, torch.Tensor)}


def first_device(named_args: dict[str, Any]) -> torch.device | None:
    return next((v.device for v in named_args.values() if isinstance(v, torch.Tensor)), None)


def searches() -> int:
    """Prunes run in this process: one per autotuning search of the package's kernels."""
    return _searches[0]


def fit(kernel: str, configs: Sequence[C], estimate: Callable[[C], int], limit: int | None, call: str = "",
        count: bool = True) -> list[C]:
    """The members of ``configs`` whose ``estimate`` is at most ``limit`` (all of them when ``limit`` is ``None``).

    Raises :class:`SharedMemoryError` when none fits, naming ``kernel``, the ``call`` (e.g. ``"head dim 192, bf16"``),
    the smallest estimate and the limit. Counts one search (:func:`searches`) unless ``count`` is false (a choice
    that is not an autotuning search)."""
    if count:
        with _lock:
            _searches[0] += 1
    if limit is None:
        return list(configs)
    sized = [(c, int(estimate(c))) for c in configs]
    kept = [c for c, need in sized if need <= limit]
    if not kept:
        smallest = min((need for _, need in sized), default=0)
        where = f" ({call})" if call else ""
        raise SharedMemoryError(
            f"{kernel}{where}: none of its {len(sized)} autotuning configurations fits the device's shared memory: "
            f"the smallest needs an estimated {smallest} bytes, the limit per block is {limit} bytes"
        )
    return kept


def describe(values: Iterable[tuple[str, Any]]) -> str:
    """``"head dim 192, bf16"``-style text of the call's sizes for :func:`fit`'s error (``None`` values skipped)."""
    return ", ".join(f"{k} {v}" for k, v in values if v is not None)
