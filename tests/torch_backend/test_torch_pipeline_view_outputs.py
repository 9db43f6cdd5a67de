"""What ``step(return_outputs=True)`` and ``eval`` return: the values torch's schedules
return, every tensor detached, where torch's keep a graph in two cases.

torch 2.13's last stage detaches its outputs in place after their backward ("to release
autograd graph context and free memory earlier"), except a view, which cannot be detached
in place: an output ``y[:, :1]`` comes back requiring grad, merged by a ``cat`` that keeps
it (``CatBackward0``), its graph holding the stage's inputs and their gradients, and a
backward through it fails (the step's backward freed it). Its ``eval`` runs the forwards
with gradients on, so its outputs and losses come back with their graphs and saved
activations. xgrad returns the same values detached: the graph torch means to free, freed
(documented in ``step``'s and ``eval``'s docstrings). On two gloo ranks, 1F1B.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M = 4


class _Head(nn.Module):
    """The last stage: a tensor and a view of it (a slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3).double()

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(h)
        return y, y[:, :2]


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out[1], target)


def _part(rank: int) -> nn.Module:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(3, 5), nn.Tanh()).double(), _Head()][rank]


def _graph(t: torch.Tensor) -> tuple[bool, str | None, str]:
    """Whether ``t`` requires grad, its grad_fn, and what a backward through it does."""
    outcome = "no graph"
    if t.requires_grad:
        try:
            t.sum().backward()
            outcome = "ran"
        except RuntimeError as exc:
            outcome = str(exc).split(" (")[0].split(".")[0]
    return t.requires_grad, None if t.grad_fn is None else type(t.grad_fn).__name__, outcome


def _both(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from xgrad.torch_backend.pipeline import PipelineRuntime

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randn(8, 2, generator=g, dtype=torch.float64) if rank == 1 else None
    args = (x,) if rank == 0 else ()
    theirs = Schedule1F1B(PipelineStage(_part(rank), rank, 2, torch.device("cpu")), M, _loss)
    rt = PipelineRuntime(xp.one_f_one_b(2, M), [_part(rank)], _loss, timeout=20)
    out: dict[str, Any] = {}
    for side, step, evaluate in (
        ("torch", lambda **kw: theirs.step(*args, **kw), lambda **kw: theirs.eval(*args, **kw)),
        ("ours", lambda **kw: rt.step(x, return_outputs=True, **kw), lambda **kw: rt.eval(x, **kw)),
    ):
        got = step(target=y)
        losses: list[Any] = []
        evaluated = evaluate(target=y, losses=losses)
        if got is None:
            continue
        out[side] = {
            "step": [t.detach().clone() for t in got],
            "eval": [t.detach().clone() for t in evaluated],
            "step_graph": [_graph(t) for t in got],
            "eval_graph": [_graph(t) for t in evaluated],
            "losses_graph": [t.requires_grad for t in losses],
        }
    return out


def test_outputs_are_torchs_values_every_one_detached() -> None:
    _, last = spawn(_both, 2, timeout=120)
    theirs, ours = last["torch"], last["ours"]
    for key in ("step", "eval"):
        for got, want in zip(ours[key], theirs[key], strict=True):
            assert torch.equal(got, want)  # bit for bit
    # torch's: the tensor detached, the view (merged by cat) with a graph that is gone.
    freed = "Trying to backward through the graph a second time"
    assert theirs["step_graph"] == [(False, None, "no graph"), (True, "CatBackward0", freed)]
    # Its eval: every output and loss with a graph (a backward through it runs).
    assert [(r, f) for r, f, _ in theirs["eval_graph"]] == [(True, "CatBackward0")] * 2
    assert theirs["eval_graph"][0][2] == "ran"
    assert theirs["losses_graph"] == [True] * M
    # xgrad's: every one detached.
    assert ours["step_graph"] == ours["eval_graph"] == [(False, None, "no graph")] * 2
    assert ours["losses_graph"] == [False] * M
