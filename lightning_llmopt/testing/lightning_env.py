"""A Lightning ``ClusterEnvironment`` over a process group that already exists (a :class:`DistributedPool` worker).

``Trainer(strategy=SomeStrategy(cluster_environment=PoolEnvironment()), devices=world)`` inside a pool task reuses
the worker's gloo group: Lightning launches nothing (``creates_processes_externally``) and reads the ranks from it.
"""

from __future__ import annotations

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

__all__ = ["PoolEnvironment"]


class PoolEnvironment(ClusterEnvironment):
    """The ranks of an already initialised default process group (one node)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return dist.get_rank()

    def node_rank(self) -> int:
        return 0
