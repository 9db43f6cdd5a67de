"""A ``loss_fn`` module with parameters of its own, under the runtime's division by m.

Since the runtime divides the gradients by m after the backward, as torch's schedules do
(``pipeline_scale``), each microbatch's loss is differentiated as it is: the loss's own
parameters (a learnt temperature) got m times the unpipelined model's gradient, as torch's
(which divides its stages' parameters alone), where the runtime gave the unpipelined
model's before. They are divided with the last stage's: on two gloo ranks, the loss
parameter's and the stages' gradients are the whole batch's, to 1e-12.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: (schedule, m): one stage a rank, and two (interleaved; its last stage on rank 1).
CASES = [("gpipe", 3), ("1f1b", 5), ("interleaved_1f1b", 3)]


class TemperedLoss(nn.Module):
    """An MSE loss of the output times a learnt temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output * self.t, target)


def _case(rank: int, name: str, m: int) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 2, m)
    n = schedule.num_stages
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    y = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    reference = TemperedLoss()
    out = x
    for part in parts:
        out = part(out)
    reference(out, y).backward()
    mine = schedule.stages_of(rank)
    want = [p.grad.clone() for s in mine for p in parts[s].parameters()]
    for part in parts:
        part.zero_grad(set_to_none=True)
    loss_fn = TemperedLoss()
    rt = PipelineRuntime(schedule, [parts[s] for s in mine], loss_fn, timeout=30)
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    rt.step(x if first else None, y if last else None)
    got = [p.grad for s in mine for p in parts[s].parameters()]
    stages = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    found: dict[str, Any] = {"stages": stages, "t": None}
    if last:
        assert loss_fn.t.grad is not None and reference.t.grad is not None
        found["t"] = (loss_fn.t.grad.item(), reference.t.grad.item())
    return found


def _run(rank: int, world: int) -> list[dict[str, Any]]:
    return [_case(rank, name, m) for name, m in CASES]


def test_a_loss_parameter_gets_the_whole_batch_gradient() -> None:
    results = spawn(_run, 2, timeout=90)
    for k, (name, m) in enumerate(CASES):
        for rank in range(2):
            found = results[rank][k]
            assert found["stages"] < 1e-12, (name, m, rank, found)
            if found["t"] is not None:
                got, want = found["t"]
                assert abs(got - want) < 1e-12, f"{name}, m={m}: loss parameter {got} != {want}"
