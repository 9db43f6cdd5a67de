"""``step(return_outputs=)`` and ``step(loss_kwargs=)``, as torch's pipeline schedules take
them.

torch 2.13's ``schedule.step(*args, target=None, losses=None, return_outputs=True,
loss_kwargs=None, **kwargs)`` returns the last stage's outputs, merged along the batch
dimension (``None`` elsewhere, and everywhere with ``return_outputs=False``), and calls
``loss_fn(output, target, **loss_kwargs)``. xgrad's ``step`` returns the loss and took
neither keyword: ``return_outputs=None`` (its default) keeps that, ``True`` returns what
torch's returns. On two gloo ranks, each running torch's ScheduleGPipe / Schedule1F1B and
then xgrad's runtime on the same stage, weights and batch.
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


class _Head(nn.Module):
    """The last stage: its output a tensor, or a tuple of two (torch's stages take no dict)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2).double()
        self.kind = kind

    def forward(self, h: torch.Tensor) -> Any:
        y = self.lin(h)
        return y if self.kind == "tensor" else (y, 2 * h)


def _loss(out: Any, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    y = out if isinstance(out, torch.Tensor) else out[0]
    return nn.functional.mse_loss(y, target) * scale


def _part(rank: int, kind: str) -> nn.Module:
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(3, 5), nn.Tanh()).double(), _Head(kind)]
    return parts[rank]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(
        8, 2, generator=g, dtype=torch.float64
    )


def _both(rank: int, world: int, kind: str, name: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from xgrad.torch_backend.pipeline import PipelineRuntime

    x, y = _data()
    x_, y_ = (x if rank == 0 else None), (y if rank == 1 else None)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    kw = {"scale": 3.0}
    theirs = cls(PipelineStage(_part(rank, kind), rank, 2, torch.device("cpu")), M, loss_fn=_loss)
    out: dict[str, Any] = {"losses": [[], []]}
    args = (x,) if rank == 0 else ()
    out["torch"] = theirs.step(*args, target=y_, losses=out["losses"][0], loss_kwargs=kw)
    out["torch_none"] = theirs.step(*args, target=y_, return_outputs=False)
    part = _part(rank, kind)
    rt = PipelineRuntime(xp.make(name, 2, M), [part], _loss, timeout=20)
    out["ours"] = rt.step(
        x_, target=y_, losses=out["losses"][1], return_outputs=True, loss_kwargs=kw
    )
    out["ours_none"] = rt.step(x_, target=y_, return_outputs=False)
    out["loss"] = rt.step(x_, target=y_)  # xgrad's default: the loss
    out["outputs_left"] = len(rt._outputs)
    out["losses"].append([])
    out["eval"] = rt.eval(x_, target=y_, losses=out["losses"][2], loss_kwargs=kw)
    return out


def _same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert not got.requires_grad and not want.requires_grad  # both detached
        assert torch.equal(got, want)  # bit for bit
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)


@pytest.mark.parametrize("kind", ["tensor", "tuple"])
def test_return_outputs_returns_what_torchs_step_returns(kind: str) -> None:
    x, y = _data()
    whole = nn.MSELoss()(_part(1, kind).lin(_part(0, kind)(x)), y)
    for name in ("gpipe", "1f1b"):
        first, last = spawn(_both, 2, args=(kind, name), timeout=120)
        assert first["torch"] is first["ours"] is first["loss"] is first["eval"] is None
        assert first["torch_none"] is first["ours_none"] is None
        _same(last["ours"], last["torch"])
        assert last["torch_none"] is None and last["ours_none"] is None
        # loss_kwargs reached the loss on every microbatch, as torch's do.
        assert len(last["losses"][1]) == M
        assert all(torch.equal(a, b) for a, b in zip(*last["losses"][:2], strict=True))
        # eval takes them too (torch's passes them on to its step); no weight has moved.
        torch.testing.assert_close(last["losses"][2], last["losses"][1], rtol=1e-13, atol=0)
        _same(last["eval"], last["torch"])
        torch.testing.assert_close(last["loss"], whole.detach(), rtol=1e-13, atol=0)
        assert last["outputs_left"] == first["outputs_left"] == 0  # nothing kept after


def test_step_takes_torchs_return_outputs_and_loss_kwargs() -> None:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    from xgrad.torch_backend.pipeline import PipelineRuntime

    ours = inspect.signature(PipelineRuntime.step).parameters
    for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
        theirs = inspect.signature(schedule.step).parameters
        for name in ("return_outputs", "loss_kwargs"):
            assert ours[name].kind is theirs[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["return_outputs"].default is None  # xgrad's own default: the loss
    assert ours["loss_kwargs"].default is None


def _misuse(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    rt = PipelineRuntime(xp.make("1f1b", 2, M), [_part(rank, "tensor")], _loss, timeout=20)
    x, y = _data()
    x_, y_ = (x if rank == 0 else None), (y if rank == 1 else None)
    texts = []
    for bad in ({"return_outputs": 1}, {"loss_kwargs": [("scale", 2.0)]}):
        try:  # refused before any message, on every rank
            rt.step(x_, y_, **bad)
        except TypeError as exc:
            texts.append(str(exc))
    outputs = rt.step(x_, y_, return_outputs=True)
    texts.append(repr(None if outputs is None else tuple(outputs.shape)))
    return texts


def test_bad_return_outputs_and_loss_kwargs_are_refused() -> None:
    for rank, texts in enumerate(spawn(_misuse, 2, timeout=90)):
        assert texts == [
            "return_outputs=1 must be None or a bool",
            "loss_kwargs must be a dict, got a list",
            "(8, 2)" if rank == 1 else "None",
        ]
