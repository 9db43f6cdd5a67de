"""``scale_grads``, ``step(losses=)`` and ``step(target=)``, as torch's pipeline schedules
have them.

A loss that sums over its batch (``reduction="sum"``) gave gradients 1/m of the whole
model's, with no way to say otherwise; torch's schedules take ``scale_grads=False``. And
torch's ``step(..., losses=)`` fills a list with each microbatch's loss, which xgrad's
``step`` did not take; nor torch's name for the targets, ``target=`` (a TypeError for a
torch user's ``runtime.step(x, target=y)``). On two gloo ranks, against the whole model in
one process.
"""

from __future__ import annotations

import inspect
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


def test_step_and_eval_take_torchs_keywords() -> None:
    # torch's schedules: step(*args, target=None, losses=None, ...), eval likewise.
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    from xgrad.torch_backend.pipeline import PipelineRuntime

    for method in ("step", "eval"):
        ours = inspect.signature(getattr(PipelineRuntime, method)).parameters
        for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
            theirs = inspect.signature(getattr(schedule, method)).parameters
            for name in ("target", "losses"):
                assert ours[name].kind is theirs[name].kind is inspect.Parameter.KEYWORD_ONLY
                assert ours[name].default is theirs[name].default is None


def _torch_names(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = _parts()[rank]
    rt = PipelineRuntime(xp.make("1f1b", 2, M), [part], nn.MSELoss(), timeout=20)
    whole = _data()
    x, y = (whole[0] if rank == 0 else None), (whole[1] if rank == 1 else None)
    out: dict[str, Any] = {"losses": [[], [], []], "grads": []}
    out["loss"] = [
        rt.step(x, y, losses=out["losses"][0]),
        rt.step(x, target=y, losses=out["losses"][1]),  # as torch's schedule.step
    ]
    out["grads"] = [p.grad.clone() for p in part.parameters() if p.grad is not None]  # 2 steps
    out["eval"] = rt.eval(x, target=y, losses=out["losses"][2])
    out["both"] = []
    for call in (rt.step, rt.eval):
        try:
            call(*whole, target=whole[1])  # refused before any message, on every rank
        except TypeError as exc:
            out["both"].append(str(exc))
    out["after"] = rt.step(x, targets=y)
    return out


def test_target_is_torchs_name_for_targets() -> None:
    parts = _parts()
    x, y = _data()
    whole = nn.MSELoss()(parts[1](parts[0](x)), y)
    (2 * whole).backward()
    results = spawn(_torch_names, 2, timeout=90)
    for rank in (0, 1):
        got = results[rank]
        for grad, p in zip(got["grads"], parts[rank].parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(grad, p.grad, rtol=1e-13, atol=1e-15)
        assert got["both"] == [
            f"PipelineRuntime.{method}() got multiple values for argument 'targets': "
            "targets and target= (torch's name for it); give one"
            for method in ("step", "eval")
        ]
    last = results[1]
    assert last["loss"][0] == last["loss"][1] == last["after"]
    torch.testing.assert_close(last["loss"][0], whole.detach(), rtol=1e-13, atol=0)
    assert last["losses"][0] == last["losses"][1] and len(last["losses"][0]) == M
    torch.testing.assert_close(last["losses"][2], last["losses"][0], rtol=1e-13, atol=0)
    torch.testing.assert_close(last["eval"], parts[1](parts[0](x)).detach(), rtol=1e-13, atol=0)
    assert results[0]["loss"] == [None, None] and results[0]["eval"] is None
