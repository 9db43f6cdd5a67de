"""Module-level ``nn.Parameter`` s a stage's forward reads by their global names, averaged
over ``dp_group``.

Two of one dtype and shape (two learnt scalar gains) found in the stages' graphs could
only be told apart by where they are held, and the walk of a stage's module looked at its
attributes alone, not at the globals its ``forward`` names: every replica refused them
("cannot tell which is which"), though the message itself says to name them as globals.
The walk now takes the functions of the module's class too, as it takes a loss
function's code, so they are ordered by name, whatever order each replica reads them in.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

ALPHA = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
BETA = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
M = 3


class Gained(nn.Module):
    """A tanh layer times the two global gains, read in the order ``flip`` says."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.flip = flip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h * BETA * ALPHA if self.flip else h * ALPHA * BETA


def _model(flip: bool) -> list[Gained]:
    torch.manual_seed(0)
    for gain in (ALPHA, BETA):
        gain.grad = None
    return [Gained(flip) for _ in range(2)]


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * M, 4, generator=g, dtype=torch.float64) + rank


def _replica(rank: int, world: int) -> dict[str, Any]:
    """This rank as one replica of a one-rank pipeline; replica 1 reads BETA first."""
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0]), dist.new_group([1])]
    dp = dist.new_group([0, 1])
    found: dict[str, Any] = {}
    for name in ("interleaved_1f1b", "zbv"):
        stages = _model(flip=rank == 1)
        schedule = xp.make(name, 1, M)
        loss = nn.functional.mse_loss
        rt = PipelineRuntime(schedule, stages, loss, group=pipes[rank], dp_group=dp, timeout=10)
        try:
            rt.step(*_data(rank))
        except Exception as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
            continue
        found[name] = [ALPHA.grad.clone(), BETA.grad.clone()]  # type: ignore[union-attr]
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_replica, 2, timeout=60)


def _reference() -> list[torch.Tensor]:
    """The unpipelined model's gradients of the two gains on each replica's batch,
    averaged."""
    sums = []
    for rank in (0, 1):
        stages = _model(flip=False)
        x, t = _data(rank)
        pairs = zip(x.tensor_split(M), t.tensor_split(M), strict=True)
        total = sum(nn.functional.mse_loss(stages[1](stages[0](xk)), tk) / M for xk, tk in pairs)
        total.backward()  # type: ignore[union-attr]
        sums.append([ALPHA.grad.clone(), BETA.grad.clone()])  # type: ignore[union-attr]
    return [(a + b) / 2 for a, b in zip(*sums, strict=True)]


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_global_gains_alike_are_averaged_by_name(results: list[dict[str, Any]], name: str) -> None:
    want = _reference()
    for rank in (0, 1):
        got = results[rank][name]
        assert not isinstance(got, str), got
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (rank, got, want)


def test_the_order_is_where_the_stages_code_names_them() -> None:
    """``in_order`` on a stage's module: the globals its ``forward`` names have their
    positions there, the same whatever order they were found in; none alike."""
    from xgrad.torch_backend.pipeline_loss_order import in_order

    stage = Gained(flip=False)
    ordered, keys, alike = in_order([BETA, ALPHA], stage)
    assert not alike and len({k[0] for k in keys}) == 2 and min(k[0] for k in keys) >= 0
    again = in_order([ALPHA, BETA], stage)[0]
    assert [id(t) for t in again] == [id(t) for t in ordered]
