"""``scale_grads`` and ``step(losses=)``, as torch's pipeline schedules have them.

A loss that sums over its batch (``reduction="sum"``) gave gradients 1/m of the whole
model's, with no way to say otherwise; torch's schedules take ``scale_grads=False``. And
torch's ``step(..., losses=)`` fills a list with each microbatch's loss, which xgrad's
``step`` did not take. On two gloo ranks, against the whole model in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M = 4


def _parts() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(3, 5), nn.Tanh()).double(), nn.Linear(5, 2).double()]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(
        8, 2, generator=g, dtype=torch.float64
    )


def _run(rank: int, world: int, name: str, reduction: str, scale: bool) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = _parts()[rank]
    loss_fn = nn.MSELoss(reduction=reduction)
    rt = PipelineRuntime(xp.make(name, 2, M), [part], loss_fn, scale_grads=scale, timeout=20)
    x, y = _data()
    losses: list[Any] = ["stale"]  # emptied first, as torch's schedules do
    loss = rt.step(x if rank == 0 else None, y if rank == 1 else None, losses=losses)
    return {"grads": [p.grad for p in part.parameters()], "loss": loss, "losses": losses}


@pytest.mark.parametrize(("reduction", "scale"), [("sum", False), ("mean", True)])
def test_gradients_and_losses_match_the_whole_model(reduction: str, scale: bool) -> None:
    parts = _parts()
    x, y = _data()
    loss_fn = nn.MSELoss(reduction=reduction)
    out = parts[1](parts[0](x))
    # The whole batch's loss: the sum of the microbatches' (sum), or their mean (mean).
    whole = loss_fn(out, y)
    whole.backward()
    each = [loss_fn(o, t).detach() for o, t in zip(out.chunk(M), y.chunk(M), strict=True)]
    for name in ("gpipe", "1f1b"):
        results = spawn(_run, 2, args=(name, reduction, scale), timeout=90)
        for rank in (0, 1):
            for got, p in zip(results[rank]["grads"], parts[rank].parameters(), strict=True):
                assert p.grad is not None
                torch.testing.assert_close(got, p.grad, rtol=1e-13, atol=1e-15)
        assert results[0]["losses"] == ["stale"] and results[0]["loss"] is None
        torch.testing.assert_close(results[1]["loss"], whole.detach(), rtol=1e-13, atol=0)
        assert len(results[1]["losses"]) == M
        for got, want in zip(results[1]["losses"], each, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def _misuse(rank: int, world: int) -> str:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    try:
        PipelineRuntime(xp.make("gpipe", 2, M), [_parts()[rank]], nn.MSELoss(), scale_grads=1)  # type: ignore[arg-type]
    except TypeError as exc:
        return str(exc)
    return "accepted"


def test_a_scale_grads_that_is_not_a_bool_is_refused() -> None:
    for text in spawn(_misuse, 2, timeout=60):
        assert text == "scale_grads=1 must be a bool", text
