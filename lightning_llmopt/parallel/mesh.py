"""One named ``DeviceMesh`` for every parallelism: pipeline, data (ZeRO), context, tensor and expert parallelism.

Layout (outermost to innermost; ranks are laid out row-major, so the innermost dimension holds consecutive ranks,
which share a node and its fastest links)::

    ("pp", "dp", "cp", "tp")                       expert_parallel == 1
    ("pp", "dp_rep", "ep", "cp", "tp")             expert_parallel > 1: dp = dp_rep * ep

Every dimension is present even when its size is 1, so code can always ask for ``mesh["tp"]``. Flattened views:

- ``"dp_cp"``: data and context parallel ranks together. They hold the same parameters (context parallelism splits
  the sequence, not the model), so gradients are averaged and ZeRO shards over this group.
- ``"dp"``: with ``expert_parallel > 1``, the flattening of ``("dp_rep", "ep")``.

Design for the later issues: pipeline stages differ along ``"pp"`` (outermost: stage boundaries carry one activation
per micro-batch, the least traffic); experts (issue 6) are sharded over ``"ep"``, a group borrowed from the
data-parallel ranks, and replicated (ZeRO-sharded) over ``"dp_rep"`` x ``"cp"``.

:class:`ParallelDims` is pure (no ``torch.distributed`` calls): it resolves ``data_parallel="auto"`` and raises, naming
the values, before any process group or collective exists; :meth:`ParallelDims.check_nodes` checks that the
tensor- and context-parallel groups fit inside a node when there are several. :func:`build_mesh` then creates the
mesh, an :class:`NDMesh`: the root ``DeviceMesh`` plus its flattened views, indexed alike (``mesh["tp"]``,
``mesh["dp_cp"]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["NDMesh", "ParallelDims", "build_mesh", "mesh_group", "mesh_rank", "mesh_size", "positive_int"]

DIM_NAMES = ("pp", "dp", "cp", "tp")
DIM_NAMES_EP = ("pp", "dp_rep", "ep", "cp", "tp")


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallel dimension, checked against the world size.

    Arguments:
        world_size: number of ranks.
        dp: data-parallel degree (ZeRO shards over ``dp * cp``).
        tp: tensor-parallel degree.
        cp: context-parallel degree.
        pp: pipeline-parallel degree.
        ep: expert-parallel degree, borrowed from the data-parallel ranks (``dp % ep == 0``).

    Use :meth:`resolve` to build one from user arguments (``data_parallel="auto"``).
    """

    world_size: int
    dp: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "tp", "cp", "pp", "ep"):
            positive_int(name, getattr(self, name))
        product = self.dp * self.tp * self.cp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"data_parallel*tensor_parallel*context_parallel*pipeline_parallel ({self.dp}*{self.tp}*{self.cp}*"
                f"{self.pp} = {product}) != world_size ({self.world_size})"
            )
        if self.dp % self.ep != 0:
            raise ValueError(
                f"data_parallel ({self.dp}) must be divisible by expert_parallel ({self.ep}): experts "
                "are sharded over a group borrowed from the data-parallel ranks"
            )

    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel: int | str = "auto",
        tensor_parallel: int = 1,
        context_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelDims:
        """Fill ``data_parallel="auto"`` with the remaining world size and validate everything (no collectives)."""
        positive_int("world_size", world_size)
        tp = positive_int("tensor_parallel", tensor_parallel)
        cp = positive_int("context_parallel", context_parallel)
        pp = positive_int("pipeline_parallel", pipeline_parallel)
        ep = positive_int("expert_parallel", expert_parallel)
        if data_parallel == "auto":
            model_ranks = tp * cp * pp
            if world_size % model_ranks != 0:
                raise ValueError(
                    f"world_size ({world_size}) must be divisible by tensor_parallel*context_parallel*"
                    f"pipeline_parallel ({tp}*{cp}*{pp} = {model_ranks}) to fill data_parallel='auto'"
                )
            dp = world_size // model_ranks
        else:
            dp = positive_int("data_parallel", data_parallel)
        return cls(world_size=world_size, dp=dp, tp=tp, cp=cp, pp=pp, ep=ep)

    # ------------------------------------------------------------------ layout (pure)
    @property
    def dp_cp(self) -> int:
        """Size of the group that averages gradients and shards ZeRO state."""
        return self.dp * self.cp

    @property
    def dp_rep(self) -> int:
        """Data-parallel replicas of one expert shard (``dp // ep``; ``dp`` without expert parallelism)."""
        return self.dp // self.ep

    @property
    def names(self) -> tuple[str, ...]:
        return DIM_NAMES_EP if self.ep > 1 else DIM_NAMES

    @property
    def shape(self) -> tuple[int, ...]:
        if self.ep > 1:
            return (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
        return (self.pp, self.dp, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{dim name: index}`` of ``rank`` in the mesh, plus ``"dp"`` and ``"dp_cp"`` (row-major, as the mesh)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.world_size})")
        coords: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(self.names, self.shape, strict=True))):
            coords[name] = rest % size
            rest //= size
        if self.ep > 1:
            coords["dp"] = coords["dp_rep"] * self.ep + coords["ep"]
        coords["dp_cp"] = coords["dp"] * self.cp + coords["cp"]
        return dict(sorted(coords.items()))

    def base_dims(self, name: str) -> tuple[str, ...]:
        """The mesh dimensions a (possibly flattened) dimension name spans."""
        dp = ("dp_rep", "ep") if self.ep > 1 else ("dp",)
        flat = {"dp": dp, "dp_cp": (*dp, "cp")}
        if name in flat:
            return flat[name]
        if name not in self.names:
            raise ValueError(f"unknown mesh dimension {name!r}; known: {sorted({*self.names, 'dp', 'dp_cp'})}")
        return (name,)

    def group_ranks(self, name: str) -> list[list[int]]:
        """The rank lists of every group along dimension ``name`` (flattened names included); pure."""
        spanned = self.base_dims(name)
        others = [n for n in self.names if n not in spanned]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coordinates(r)
            groups.setdefault(tuple(c[n] for n in others), []).append(r)
        return list(groups.values())

    def check_nodes(self, num_nodes: int, ranks_per_node: int) -> None:
        """Raise unless every tensor- and context-parallel group lies inside one node (pure, before any collective).

        A node holds the consecutive global ranks ``node_rank * ranks_per_node + local_rank``; ``"cp"`` and ``"tp"``
        are the innermost mesh dimensions, so a group of ``tp * cp`` ranks is a block of consecutive ranks starting
        at a multiple of ``tp * cp``. It stays inside a node exactly when ``tp * cp`` divides ``ranks_per_node``;
        data and pipeline parallelism then span the nodes.
        """
        positive_int("num_nodes", num_nodes)
        positive_int("ranks_per_node", ranks_per_node)
        if num_nodes * ranks_per_node != self.world_size:
            raise ValueError(
                f"num_nodes*ranks_per_node ({num_nodes}*{ranks_per_node}) != world_size ({self.world_size})"
            )
        inner = self.tp * self.cp
        if num_nodes > 1 and ranks_per_node % inner != 0:
            raise ValueError(
                f"tensor_parallel*context_parallel ({inner}) must divide the ranks per node ({ranks_per_node}) "
                "so that TP/CP stay inside a node"
            )

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))

    # ------------------------------------------------------------------ mesh (collective)
    def build_mesh(self, device_type: str) -> NDMesh:
        """Create the named mesh (every rank must call it) with the flattened ``"dp_cp"`` (and ``"dp"``)."""
        return build_mesh(self, device_type)


class NDMesh:
    """The root ``DeviceMesh`` with its flattened views ``"dp_cp"`` (and ``"dp"`` with experts).

    ``mesh[name]`` returns the 1-D mesh of a dimension (or the sub-mesh of a tuple of names) like a ``DeviceMesh``;
    flattened views are kept here because torch deprecates slicing them from the root. Other attributes are the root
    mesh's (``mesh.ndim``, ``mesh.mesh_dim_names``, ``mesh.get_group(dim)``, ...).

    Arguments:
        root: the ``DeviceMesh`` over ``dims.names``.
        flattened: ``{name: DeviceMesh}`` of the flattened views.
        dims: the :class:`ParallelDims` it was built from.
    """

    def __init__(self, root: Any, flattened: dict[str, Any], dims: ParallelDims) -> None:
        self.root, self.flattened, self.dims = root, flattened, dims

    def __getitem__(self, name: str | tuple[str, ...]) -> Any:
        if isinstance(name, str) and name in self.flattened:
            return self.flattened[name]
        return self.root[name]

    def __getattr__(self, item: str) -> Any:
        if item in ("root", "flattened", "dims"):  # not yet set (copy/unpickle): no recursion through the root
            raise AttributeError(item)
        return getattr(self.root, item)

    def __repr__(self) -> str:
        return f"NDMesh({self.dims.describe()}, flattened={sorted(self.flattened)})"


def _flatten(mesh: Any, names: tuple[str, ...], flat_name: str) -> Any:
    sub = mesh[names] if len(names) > 1 else mesh[names[0]]
    return sub._flatten(flat_name)  # private but present from torch 2.5 to 2.13; no public equivalent yet


def build_mesh(dims: ParallelDims, device_type: str) -> NDMesh:
    """``init_device_mesh`` over ``dims`` with the flattened views (see the module docstring); every rank must call
    it, with an initialised default group of ``dims.world_size`` ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"ParallelDims is for world_size ({dims.world_size}) but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    root = init_device_mesh(device_type, dims.shape, mesh_dim_names=dims.names)
    flattened: dict[str, Any] = {}
    if dims.ep > 1:
        flattened["dp"] = _flatten(root, ("dp_rep", "ep"), "dp")
        flattened["dp_cp"] = _flatten(root, ("dp_rep", "ep", "cp"), "dp_cp")
    else:
        flattened["dp_cp"] = _flatten(root, ("dp", "cp"), "dp_cp")
    return NDMesh(root, flattened, dims)


def mesh_group(mesh: Any, name: str) -> Any:
    """The process group of dimension ``name`` that this rank belongs to."""
    return mesh[name].get_group()


def mesh_rank(mesh: Any, name: str) -> int:
    return int(mesh[name].get_local_rank())


def mesh_size(mesh: Any, name: str) -> int:
    return int(mesh[name].size())
