"""ParallelDims (pure layout and validation) and the named mesh built on gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from lightning_llmopt.parallel.mesh import ParallelDims, build_mesh


def test_auto_fills_the_world() -> None:
    dims = ParallelDims.resolve(16, tensor_parallel=2, context_parallel=2)
    assert (dims.dp, dims.tp, dims.cp, dims.pp, dims.ep) == (4, 2, 2, 1, 1)
    assert dims.dp_cp == 8 and dims.names == ("pp", "dp", "cp", "tp") and dims.shape == (1, 4, 2, 2)
    assert ParallelDims.resolve(8, data_parallel=2, tensor_parallel=4).dp == 2
    ep = ParallelDims.resolve(8, expert_parallel=2, pipeline_parallel=2)
    assert ep.names == ("pp", "dp_rep", "ep", "cp", "tp") and ep.shape == (2, 2, 2, 1, 1)


def test_coordinates_are_row_major_with_tp_innermost() -> None:
    dims = ParallelDims.resolve(8, tensor_parallel=2, context_parallel=2)  # dp=2
    assert [dims.coordinates(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [dims.coordinates(r)["cp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [dims.coordinates(r)["dp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert [dims.coordinates(r)["dp_cp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ep = ParallelDims.resolve(8, expert_parallel=2)  # dp=8 = dp_rep 4 x ep 2
    assert ep.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ep.group_ranks("dp") == [list(range(8))]
    assert ep.group_ranks("dp_rep") == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 4, "data_parallel": 3},
            r"data_parallel\*tensor_parallel\*context_parallel\*pipeline_parallel "
            r"\(3\*1\*1\*1 = 3\) != world_size \(4\)",
        ),
        ({"world_size": 6, "tensor_parallel": 4}, r"world_size \(6\) must be divisible by .* \(4\*1\*1 = 4\)"),
        ({"world_size": 4, "tensor_parallel": 0}, r"tensor_parallel \(0\) must be a positive integer"),
        ({"world_size": 4, "context_parallel": True}, r"context_parallel \(True\) must be a positive integer"),
        ({"world_size": 4, "data_parallel": "two"}, r"data_parallel \('two'\) must be a positive integer"),
        ({"world_size": 6, "expert_parallel": 4}, r"data_parallel \(6\) must be divisible by expert_parallel \(4\)"),
    ],
)
def test_errors_name_the_values(kwargs: dict[str, Any], message: str) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(world, **kwargs)


def test_unknown_dimension_is_named() -> None:
    with pytest.raises(ValueError, match="unknown mesh dimension 'xp'"):
        ParallelDims.resolve(4).group_ranks("xp")


def _mesh_groups(layouts: list[dict[str, int]]) -> list[dict[str, Any]]:
    """Worker: build each layout's mesh; report this rank's group members per dimension."""
    out = []
    for degrees in layouts:
        dims = ParallelDims.resolve(dist.get_world_size(), **degrees)
        mesh = build_mesh(dims, "cpu")
        names = [*dims.names, "dp_cp"] + (["dp"] if dims.ep > 1 else [])
        out.append({n: sorted(dist.get_process_group_ranks(mesh[n].get_group())) for n in names})
    wrong = ParallelDims.resolve(2 * dist.get_world_size())
    try:
        build_mesh(wrong, "cpu")
    except ValueError as exc:
        out.append({"error": str(exc)})
    return out


def test_mesh_groups_match_the_layout(dist_pool: Any) -> None:
    layouts = [
        {"tensor_parallel": 2},
        {"context_parallel": 2},
        {"data_parallel": 2, "tensor_parallel": 2},
        {"expert_parallel": 2},
    ]
    results = dist_pool(4).run(_mesh_groups, layouts)
    for i, degrees in enumerate(layouts):
        dims = ParallelDims.resolve(4, **degrees)
        for rank, result in enumerate(results):
            for name, members in result[i].items():
                expected = next(g for g in dims.group_ranks(name) if rank in g)
                assert members == expected, (degrees, name, rank)
    assert all(
        r[-1]["error"] == "ParallelDims is for world_size (8) but the process group has 4 ranks" for r in results
    )
