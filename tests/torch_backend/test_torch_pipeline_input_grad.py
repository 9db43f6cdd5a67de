"""The gradient of the step's own input batch, when it requires grad, under every schedule.

An input that requires grad (an adversarial example, a penalty on the input) got the whole
model's gradient under GPipe and 1F1B, but ``None`` under the split-backward schedules
(ZB-H1, ZB-H2, interleaved ZB, ZBV), and only the microbatches that DualPipeV ran with a full
B under it (the others stayed zero), without a word: the first stage's I pass has nothing
of the stage's to differentiate, and its W pass took the parameters only. On two gloo
ranks, against the whole model in one process, in every checkpoint mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M, WIDTH = 4, 3
SCHEDULES = ("gpipe", "zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev")


def _schedule(name: str) -> xp.Schedule:
    two = name in ("interleaved_zb", "zbv", "dualpipev")
    return xp.make(name, 2, M, chunks=2) if two else xp.make(name, 2, M)


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(n)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)


def _run(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    out: dict[str, Any] = {}
    for name in SCHEDULES:
        schedule = _schedule(name)
        stages = _stages(schedule.num_stages)
        mine = schedule.stages_of(rank)
        x, y = _data()
        x.requires_grad_()
        rt = PipelineRuntime(
            schedule, [stages[s] for s in mine], nn.MSELoss(), checkpoint=checkpoint, timeout=20
        )
        rt.step(x, y)
        if 0 in mine:
            out[name] = x.grad
    return out


def _whole(n: int) -> torch.Tensor:
    """The input's gradient through the ``n`` stages run as one model."""
    x, y = _data()
    x.requires_grad_()
    h = x
    for stage in _stages(n):
        h = stage(h)
    nn.functional.mse_loss(h, y).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_input_batch_gets_the_whole_models_gradient(checkpoint: str) -> None:
    results = spawn(_run, 2, args=(checkpoint,), timeout=120)
    assert sorted(results[0]) == sorted(SCHEDULES)  # rank 0 holds stage 0 in each
    for name in SCHEDULES:
        got = results[0][name]
        assert got is not None, name
        want = _whole(_schedule(name).num_stages)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=name)
