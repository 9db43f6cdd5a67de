"""A ``loss_fn`` module with parameters of its own, under the runtime's division by m.

Since the runtime divides the gradients by m after the backward, as torch's schedules do
(``pipeline_scale``), each microbatch's loss is differentiated as it is: the loss's own
parameters (a learnt temperature) got m times the unpipelined model's gradient, as torch's
(which divides its stages' parameters alone), where the runtime gave the unpipelined
model's before. They are divided with the last stage's: on two gloo ranks, the loss
parameter's and the stages' gradients are the whole batch's, to 1e-12.

Under zero bubble (the backward split into I and W) the loss's parameters got no gradient
at all (``.grad`` None, as torch 2.13's ZBV and interleaved zero bubble leave it): W
differentiated the stage's parameters alone. Now the last stage's W differentiates them
too, from the joins or from the loss, checkpointed or not; a second step without
``zero_grad`` adds the same gradient again (set aside and added back as the stages').
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: (schedule, m, checkpoint): one stage a rank, and two (interleaved: its last stage on
#: rank 1; zbv, dualpipev: on rank 0); the zero-bubble ones split the backward into I and
#: W (which left the loss's parameter None), checkpointed or not; W from the joins the I
#: pass found, or (``"never, plain W"``) the plain W pass from the loss.
CASES = [
    ("gpipe", 3, "except_last"),
    ("1f1b", 5, "except_last"),
    ("interleaved_1f1b", 3, "except_last"),
    *(
        (name, m, mode)
        for name, m in (("zb_h1", 3), ("interleaved_zb", 3), ("zbv", 5), ("dualpipev", 5))
        for mode in ("never", "always")
    ),
    ("zb_h2", 6, "except_last"),
    ("zbv", 3, "never"),
    ("zb_h1", 3, "never, plain W"),
    ("zbv", 5, "never, plain W"),
]


class TemperedLoss(nn.Module):
    """An MSE loss of the output times a learnt temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output * self.t, target)


def _case(rank: int, name: str, m: int, checkpoint: str) -> dict[str, Any]:
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
    rt = PipelineRuntime(
        schedule, [parts[s] for s in mine], loss_fn, timeout=30, checkpoint=checkpoint.split(",")[0]
    )
    rt.w_from_joins = "plain" not in checkpoint
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    rt.step(x if first else None, y if last else None)
    again = None if loss_fn.t.grad is None else loss_fn.t.grad.item()
    rt.step(x if first else None, y if last else None)  # no zero_grad: twice the gradient
    for s in mine:
        for p in parts[s].parameters():
            assert p.grad is not None
            p.grad /= 2
    got = [p.grad for s in mine for p in parts[s].parameters()]
    stages = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    found: dict[str, Any] = {"stages": stages, "t": None}
    if last:
        assert reference.t.grad is not None
        twice = None if loss_fn.t.grad is None else loss_fn.t.grad.item() / 2
        found["t"] = (again, reference.t.grad.item())
        found["twice"] = twice
    return found


def _run(rank: int, world: int) -> list[dict[str, Any]]:
    return [_case(rank, *case) for case in CASES]


def test_a_loss_parameter_gets_the_whole_batch_gradient() -> None:
    results = spawn(_run, 2, timeout=90)
    for k, (name, m, mode) in enumerate(CASES):
        lasts = 0
        for rank in range(2):
            found = results[rank][k]
            assert found["stages"] < 1e-12, (name, m, mode, rank, found)
            if found["t"] is not None:
                lasts += 1
                got, want = found["t"]
                what = f"{name}, m={m}, checkpoint={mode}: loss parameter"
                assert got is not None, f"{what} has no gradient (want {want})"
                assert abs(got - want) < 1e-12, f"{what} {got} != {want}"
                twice = found["twice"]
                assert abs(twice - want) < 1e-12, f"{what}, two steps: {twice} * 2 != 2 * {want}"
        assert lasts == 1, (name, m, mode)
