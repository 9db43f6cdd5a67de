"""A raise in a static graph's first iteration, on two gloo ranks.

Rank 1 raises in its forward (or in a gradient hook) in the first iteration of a
``static_graph=True`` DDP; both ranks catch it and go on. Rank 0 had finished that
iteration's backward, learning the static graph, before its reduction failed; rank 1 had
not. Before, the ranks then went different ways: rank 0 kept a ready order and rebuilt
its buckets at the third step while rank 1 was still learning, and every step from the
third on waited out the timeout, naming a rank at random, for good. Now what a failed
step taught is undone on every rank (``Reducer.restore_step_state``), and the steps after
it give the mean of the ranks' local gradients.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return (
        torch.randn(4, 5, generator=g, dtype=torch.float64),
        torch.randn(4, 2, generator=g, dtype=torch.float64),
    )


def _run(rank: int, world: int, where: str, race: bool = False) -> list[Any]:
    from xgrad.torch_backend import DistributedDataParallel

    model = _model()
    ddp = DistributedDataParallel(model, static_graph=True, timeout=5.0)
    armed, first = [False], [True]
    if race:
        _late_agreement(rank, first)

    def forward_hook(module: Any, args: Any) -> None:
        if armed[0] and where == "forward":
            raise ValueError("boom in the first forward")

    def gradient_hook(g: torch.Tensor) -> torch.Tensor:
        if armed[0] and where == "backward":
            raise ValueError("boom in the first backward")
        return g

    model[2].register_forward_pre_hook(forward_hook)
    model[2].weight.register_hook(gradient_hook)
    out: list[Any] = []
    for step in range(STEPS):
        armed[0] = rank == 1 and step == 0
        x, y = _data(step, rank)
        ddp.zero_grad(set_to_none=True)
        try:
            ((ddp(x) - y) ** 2).mean().backward()
            out.append([p.grad.clone() for p in model.parameters()])
        except Exception as exc:
            out.append(str(exc))
        first[0] = False
    return out


def _late_agreement(rank: int, first: list[bool]) -> None:
    """In the first step's agreement (two all-gathers): rank 1 comes 0.3 s late to the
    second, and rank 0, napping in its wait for it, is held 0.5 s before it reads the
    channel. The all-gather completes on both; rank 1 goes on, raises in its backward pass
    and posts that at its next forward, which rank 0 reads first, before it sees its own
    all-gather complete (as a loaded machine had it once in eight runs)."""
    from xgrad.torch_backend import ddp_failure, ddp_watched_comm

    state = {"gathering": False, "done": False}
    gather, check = ddp_watched_comm.WatchedComm._bytes, ddp_failure.StepWatch._check

    def late_gather(self: Any, obj: Any, length: int) -> Any:
        if first[0] and not state["done"]:
            state["done"] = rank == 1  # rank 1: late once; rank 0: held at the next check
            state["gathering"] = rank == 0
            if rank == 1:
                time.sleep(0.3)
        return gather(self, obj, length)

    def held_check(self: Any) -> None:
        if state["gathering"]:
            state["gathering"], state["done"] = False, True
            time.sleep(0.5)
        check(self)

    ddp_watched_comm.WatchedComm._bytes = late_gather  # type: ignore[method-assign]
    ddp_failure.StepWatch._check = held_check  # type: ignore[method-assign]


@pytest.mark.parametrize("where", ["forward", "backward", "race"])
def test_a_failed_first_static_iteration_is_learned_again_alike(where: str) -> None:
    """``race``: rank 0 raised rank 1's failure though its agreement had completed, and
    kept it pending while rank 1 had cleared it: from the next step on, rank 0 all-gathered
    while rank 1 reduced, to the timeout, every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ("backward", True) if where == "race" else (where,)
        results = spawn(_run, 2, args=args, timeout=120)
    if where == "race":
        where = "backward"
    local = _model()
    for step in range(1, STEPS):
        grads = []
        for rank in range(2):
            x, y = _data(step, rank)
            local.zero_grad(set_to_none=True)
            ((local(x) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in local.parameters()])
        want = [(a + b) / 2 for a, b in zip(*grads, strict=True)]
        for rank in range(2):
            got = results[rank][step]
            assert isinstance(got, list), (where, rank, step, got)
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, rtol=1e-12, atol=1e-14), (where, rank, step)
    assert "boom in the first" in results[1][0]
    assert results[0][0].startswith(f"rank 1 in {where}"), results[0][0]
