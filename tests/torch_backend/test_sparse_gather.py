"""Summing sparse tensors by all-gather (``sparse_gather``) against gloo's sparse all-reduce.

On real gloo groups of 2 and 3 ranks, every case is summed both ways and compared bit for
bit: the indices, the values' bytes and whether the result is coalesced. At three ranks
the order of the additions shows in the last bits, so agreeing there means the
all-gather sums as gloo does. Ranks whose tensors disagree raise on every rank, naming
the rank, and the group still works after.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from xgrad.torch_backend.sparse_gather import (
    SparseGather,
    device_backend,
    gathers_sparse,
    reduces_sparse,
    sparse_sum,
)
from xgrad.torch_backend.spawn import spawn

ROWS = 12


def _tensor(rank: int, case: str, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor of ``case``: uncoalesced (repeated indices), values over
    seven orders of magnitude, so a different order of additions changes the last bits."""
    g = torch.Generator().manual_seed(10 * rank + len(case))
    n = 0 if case == "empty_on_1" and rank == 1 else 9
    if case == "none":
        n = 0
    if case == "disjoint":
        rows = torch.randint(0, 4, (1, n), generator=g) + 4 * rank
    elif case == "matrix":  # two sparse dimensions, scalar values
        rows = torch.randint(0, 4, (2, n), generator=g)
    else:
        rows = torch.randint(0, 5, (1, n), generator=g)
    dense = () if case == "matrix" else (3,)  # embedding rows of 3
    scale = 10.0 ** torch.randint(-3, 4, (n, *dense), generator=g)
    values = (torch.randn(n, *dense, generator=g, dtype=torch.float64) * scale).to(dtype)
    shape = (4, 4) if case == "matrix" else (ROWS, 3)
    return torch.sparse_coo_tensor(rows, values, shape, check_invariants=True)


def _bits(t: torch.Tensor) -> tuple[list[int], bytes, bool, list[int]]:
    t = t.detach()
    values = t._values().contiguous().flatten().view(torch.uint8)
    return t._indices().flatten().tolist(), bytes(values.tolist()), t.is_coalesced(), list(t.shape)


CASES = ["overlapping", "disjoint", "empty_on_1", "none", "matrix"]


def _compare(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        for dtype in (torch.float32, torch.float64):
            mine = _tensor(rank, case, dtype)
            gloo = mine.clone()
            dist.all_reduce(gloo)
            gathered = sparse_sum(mine)
            in_place = mine.clone()
            returned = SparseGather(in_place, in_place=True).wait()
            out[f"{case} {dtype}"] = {
                "same": _bits(gathered) == _bits(gloo),
                "in_place": returned is in_place and _bits(in_place) == _bits(gloo),
                "input_kept": _bits(mine) == _bits(_tensor(rank, case, dtype)),
                "nnz": gloo._nnz(),
            }
    out["mismatch"] = _mismatch(rank, world)
    out["cpu_gathers"] = gathers_sparse(None, torch.device("cpu"))
    return out


def _mismatch(rank: int, world: int) -> dict[str, Any]:
    """The last rank's tensor has 4 values per row, the others 3: every rank raises."""
    dense = 4 if rank == world - 1 else 3
    t = torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.ones(2, dense), (ROWS, dense), check_invariants=True
    )
    try:
        sparse_sum(t)
        error = ""
    except ValueError as exc:
        error = str(exc)
    after = torch.ones(2)
    dist.all_reduce(after)  # the group still works: no collective was left behind
    return {"error": error, "after": after.tolist()}


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    return spawn(_compare, world, timeout=90)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_all_gather_sum_is_bit_identical_to_gloos_sparse_all_reduce(world: int, case: str) -> None:
    for rank, result in enumerate(_results(world)):
        for dtype in ("torch.float32", "torch.float64"):
            got = result[f"{case} {dtype}"]
            assert got["same"] and got["in_place"] and got["input_kept"], (rank, dtype, got)
            assert (got["nnz"] > 0) == (case != "none"), (rank, dtype, got)


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_that_differ_across_ranks_raise_on_every_rank_naming_the_rank(
    world: int,
) -> None:
    last = world - 1
    for rank, result in enumerate(_results(world)):
        error = result["mismatch"]["error"]
        assert f"rank {last}'s (shape [{ROWS}, 4], 1 sparse, 1 dense" in error, (rank, error)
        assert f"differs from rank 0's (shape [{ROWS}, 3]," in error, (rank, error)
        assert result["mismatch"]["after"] == [world, world], rank


def test_the_path_is_chosen_by_the_groups_backend_for_the_device() -> None:
    assert device_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert device_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert device_backend("cuda:nccl", "cpu") == ""
    assert reduces_sparse("gloo")
    assert not reduces_sparse("nccl")
    assert not reduces_sparse("")
    # A gloo group (spawn's) all-reduces sparse CPU tensors itself.
    assert not any(result["cpu_gathers"] for result in _results(2))
