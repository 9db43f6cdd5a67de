"""A parameter of ``delay_all_reduce_named_params`` that some ranks leave out of a pass.

A bias added to the output on rank 0 only (and on every rank at the last step), delayed,
with the first layer's weight hooked. The rank that left the bias out counted its
delayed gradients short and put its buffer's reduction at the end of the pass, the
others at the hooked gradient: gloo matched the buffer against a bucket of another size
and aborted the process. Under ``find_unused_parameters`` PyTorch's DDP gives the mean
there; xgrad's must give PyTorch's gradients, bit for bit. Without it PyTorch's DDP does
not finish the pass on gloo (not run here); xgrad's gives the mean.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class _AddedSometimes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor, add: bool) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return h + self.extra if add else h


def _grads(cls: Any, base: nn.Module, rank: int, find_unused: bool) -> list[list[torch.Tensor]]:
    import torch.distributed as dist

    model = copy.deepcopy(base)
    ddp = cls(
        model,
        delay_all_reduce_named_params=[("extra", model.extra)],
        param_to_hook_all_reduce=model.a.weight,
        find_unused_parameters=find_unused,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        ddp(x, rank == 0 or step == 2).square().sum().backward()
        # PyTorch never waits for its delayed all-reduce; a barrier queued behind it does.
        dist.barrier()
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return out


def _local_mean(base: nn.Module, rank: int, world: int) -> list[list[torch.Tensor]]:
    """The mean over the ranks of each rank's own gradients, step by step (SGD as above)."""
    import torch.distributed as dist

    model = copy.deepcopy(base)
    out = []
    for step in range(3):
        model.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x, rank == 0 or step == 2).square().sum().backward()
        grads = []
        for p in model.parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g)
            grads.append(g / world)
        out.append(grads)
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= 0.1 * g
    return out


def _run(rank: int, world: int, find_unused: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _AddedSometimes()
    out = {"xgrad": _grads(DistributedDataParallel, base, rank, find_unused)}
    if find_unused:
        out["torch"] = _grads(TorchDDP, base, rank, find_unused)
    else:
        out["mean"] = _local_mean(base, rank, world)
    return out


def test_a_delayed_parameter_unused_on_a_rank_gives_pytorch_s_gradients() -> None:
    for r in spawn(_run, 2, args=(True,), timeout=60):
        for mine, theirs in zip(r["xgrad"], r["torch"], strict=True):
            assert len(mine) == len(theirs) == 5
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_a_delayed_parameter_unused_on_a_rank_is_averaged(world: int) -> None:
    for r in spawn(_run, world, args=(False,), timeout=60):
        for mine, mean in zip(r["xgrad"], r["mean"], strict=True):
            assert len(mine) == len(mean) == 5
            for a, b in zip(mine, mean, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _BranchPerRank(nn.Module):
    """A branch ``c`` that each rank takes in turn, a layer ``d`` no rank takes, and a
    delayed ``extra`` every rank adds."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return (h + self.c(h) if branch else h) + self.extra


def _skipping(rank: int, world: int) -> dict[str, list[list[torch.Tensor | None]]]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _BranchPerRank()
    out: dict[str, list[list[torch.Tensor | None]]] = {"xgrad": [], "mean": []}
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(
        model,
        delay_all_reduce_named_params=[("extra", model.extra)],
        param_to_hook_all_reduce=model.a.weight,
        find_unused_parameters=True,
        skip_all_reduce_unused_params=True,
    )
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        branch = (step + rank) % 2 == 0
        model.zero_grad(set_to_none=True)
        ddp(x, branch).square().sum().backward()
        out["xgrad"].append(
            [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
        plain.zero_grad(set_to_none=True)
        plain(x, branch).square().sum().backward()
        grads: list[torch.Tensor | None] = []
        for p in plain.parameters():
            used = torch.tensor([p.grad is not None], dtype=torch.int32)
            dist.all_reduce(used)
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g)
            grads.append(g / world if used.item() else None)
        out["mean"].append(grads)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_skipping_unused_buckets_with_a_delayed_parameter_and_a_branch_per_rank(
    world: int,
) -> None:
    """``skip_all_reduce_unused_params`` sums the used map at the pass's first gradient
    mark, which a rank whose first gradients only logged their arrival made after the
    delayed all-reduce, its peers before it. Here the map (eight parameters, int32) and
    the delayed buffer (eight floats) have the same size, so gloo paired them without a
    word: ``d``, which no rank used, got a gradient, and the delayed gradient was summed
    with another rank's used map (of other sizes gloo aborted both processes; PyTorch's
    DDP asks for the same unused parameters on every rank there). The sum now goes out
    before the delayed all-reduce on every rank: the mean, ``d`` left ``None``."""
    for r in spawn(_skipping, world, timeout=60):
        for mine, mean in zip(r["xgrad"], r["mean"], strict=True):
            assert [g is None for g in mine] == [g is None for g in mean]
            assert mine[7] is None and mine[8] is None  # d: no rank used it
            for a, b in zip(mine, mean, strict=True):
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
