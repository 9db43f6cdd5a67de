"""The DDP's sparse buckets summed by all-gather (NCCL's path) equal PyTorch's DDP on gloo.

The DDP sums a sparse bucket by all-gather where the group's backend for the gradient's
device cannot all-reduce sparse tensors (NCCL). Gloo can, on the CPU and on CUDA, so
here the path is forced through the comm's private switch (``comm._gather_sparse``), on
three gloo ranks, where the order of the additions shows in the last bits: xgrad's
gradients, three steps, bit for bit against PyTorch's DDP, which all-reduces on gloo.
Construction is counted, so a run that never took the path fails. Under ``Join``
(uneven inputs: joined ranks offer empty sparse gradients) PyTorch's DDP hangs, so there
the forced path is compared with xgrad's own gloo reduction.

PyTorch cannot reduce a sparse embedding unused on one rank under
``find_unused_parameters`` (the rank raises "Expected sparse gradient to be defined" and
its peers wait out the timeout); xgrad raises that on every rank, before any reduction,
whichever path the bucket would have taken.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

WORLD = 3


class _Net(nn.Module):
    """A sparse embedding (a bucket of its own), dense layers, a branch that may go unused."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8, sparse=True)
        self.mid = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.use_branch = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(idx).sum(1)))
        return self.branch(h) if self.use_branch else h


def _bits(grad: torch.Tensor) -> tuple[list[int], bytes]:
    """A gradient as its indices and its values' bytes (a sparse one coalesced)."""
    if grad.is_sparse:
        grad = grad.coalesce()
        indices, values = grad._indices().flatten().tolist(), grad._values()
    else:
        indices, values = [], grad
    return indices, bytes(values.detach().contiguous().flatten().view(torch.uint8).tolist())


def _counting() -> list[int]:
    """Count the sums by all-gather the DDP's comm starts (one per sparse bucket)."""
    import xgrad.torch_backend.ddp_watched_comm as comm

    started = [0]
    base = comm.SparseGather

    class Counted(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started[0] += 1
            super().__init__(*args, **kwargs)

    comm.SparseGather = Counted  # type: ignore[misc]
    return started


def _steps(ddp: Any, rank: int, steps: int = 3) -> list[list[tuple[list[int], bytes]]]:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        idx = torch.randint(0, 40, (6, 3), generator=g)
        ddp.zero_grad(set_to_none=True)
        ddp(idx).square().sum().backward()
        out.append([_bits(p.grad) for p in ddp.parameters() if p.grad is not None])
    return out


def _against_pytorch(rank: int, started: list[int], **kwargs: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _Net()
    base.use_branch = not kwargs.get("find_unused_parameters", False)
    ours = DistributedDataParallel(copy.deepcopy(base), **kwargs)
    ours.comm._gather_sparse = True
    before = started[0]
    mine = _steps(ours, rank)
    theirs = _steps(TorchDDP(copy.deepcopy(base), **kwargs), rank)
    return {"same": mine == theirs, "gathers": started[0] - before}


def _joined(rank: int, started: list[int], gather: bool) -> dict[str, Any]:
    """Rank r runs 1 + r steps under ``Join``; the joined ranks shadow the others'."""
    from torch.distributed.algorithms.join import Join

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_Net())
    ddp.comm._gather_sparse = gather
    before = started[0]
    with Join([ddp]):
        grads = _steps(ddp, rank, steps=1 + rank)
    return {"grads": grads, "gathers": started[0] - before}


def _run(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel

    started = _counting()
    out: dict[str, Any] = {
        "default": _against_pytorch(rank, started),
        "find_unused": _against_pytorch(rank, started, find_unused_parameters=True),
        "static_graph": _against_pytorch(rank, started, static_graph=True),
        "bucket_view": _against_pytorch(rank, started, gradient_as_bucket_view=True),
        "join_gathered": _joined(rank, started, gather=True),
        "join_gloo": _joined(rank, started, gather=False),
    }
    # Not forced: gloo all-reduces sparse CPU tensors itself, so no all-gather.
    ddp = DistributedDataParallel(_Net())
    before = started[0]
    _steps(ddp, rank, steps=1)
    out["unforced"] = {"switch": ddp.comm._gather_sparse, "gathers": started[0] - before}
    out["mismatch"] = _mismatch(rank)  # last: the failed step ends this DDP
    return out


def _mismatch(rank: int) -> str:
    """Rank 1's embedding gradient reaches the DDP with two sparse dimensions (same shape,
    no dense one): each rank raises at once, naming rank 1."""
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_Net())
    ddp.comm._gather_sparse = True
    if rank == 1:
        ddp.module.emb.weight.register_hook(lambda g: g.coalesce().to_dense().to_sparse(2))
    try:
        _steps(ddp, rank, steps=1)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@functools.cache
def _results() -> list[dict[str, Any]]:
    return spawn(_run, WORLD, timeout=150)


@pytest.mark.parametrize("name", ["default", "find_unused", "static_graph", "bucket_view"])
def test_gathered_sparse_gradients_equal_pytorchs_ddp_on_gloo(name: str) -> None:
    for rank, result in enumerate(_results()):
        assert result[name] == {"same": True, "gathers": 3}, (rank, result[name])


def test_joined_ranks_shadow_a_gathered_sparse_bucket_as_on_gloo() -> None:
    for rank, result in enumerate(_results()):
        gathered, gloo = result["join_gathered"], result["join_gloo"]
        assert gathered["grads"] == gloo["grads"], rank
        # every rank takes part in each of the longest rank's steps
        assert (gathered["gathers"], gloo["gathers"]) == (WORLD, 0), (rank, result)


def test_ranks_whose_sparse_gradients_differ_raise_on_every_rank_naming_it() -> None:
    for rank, error in enumerate(r["mismatch"] for r in _results()):
        assert "gradient hook of emb.weight" in error, (rank, error)
        assert (
            "rank 1's (shape [40, 8], 2 sparse, 0 dense dimensions, 4-byte values) differs "
            "from rank 0's (shape [40, 8], 1 sparse, 1 dense dimensions, 4-byte values)"
        ) in error, (rank, error)


def test_without_the_switch_gloo_reduces_sparse_buckets_itself() -> None:
    for rank, result in enumerate(_results()):
        assert result["unforced"] == {"switch": None, "gathers": 0}, rank
