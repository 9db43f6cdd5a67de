"""Checkpointed stages and what they do to their inputs, on two gloo ranks.

A checkpointed forward (``checkpoint="except_last"``, the default, or ``"always"``) runs
twice: once without keeping its activations, and again right before its backward, on
the same input. Before:

* a stage that changed its input in place (``mask.add_(1)`` on a received integer mask)
  had its recomputation see the changed values, and the gradients were wrong without a
  word (the loss, from the first run, was right); now its first run raises, naming the
  action and the input, on every rank;
* a float tensor passed on without a gradient (a float mask) arrived requiring one when
  its sender's forward was checkpointed (every float output of a forward without a graph
  was taken to carry one), so its receiver could not read it with ``.numpy()`` or change
  it in place; now it arrives as it left, as with ``checkpoint="never"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

WIDTH = 4


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(d["x"])), d["mask"]  # the float mask passed through


class _Second(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.b = nn.Linear(WIDTH, WIDTH)
        self.in_place = in_place

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = t
        if self.in_place:
            mask.mul_(2.0)
        else:  # reads it as data: refused for a tensor that requires a gradient
            mask = torch.from_numpy(mask.numpy() * 2.0)
        return torch.tanh(self.b(h)) * mask.unsqueeze(-1)


def _data() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(16, WIDTH, generator=g, dtype=torch.float64)
    mask = torch.randint(0, 3, (16,), generator=g).double()
    return {"x": x, "mask": mask}, y


def _parts(in_place: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    return [_First().double(), _Second(in_place).double()]


def _run(rank: int, world: int, checkpoint: str, in_place: bool) -> Any:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = _parts(in_place)[rank]
    rt = PipelineRuntime(
        xp.make("1f1b", 2, 4), [part], nn.functional.mse_loss, checkpoint=checkpoint, timeout=20
    )
    d, y = _data()
    out = []
    for _ in range(2):  # the next step fails alike, or works alike
        try:
            rt.step(d if rank == 0 else None, y if rank == 1 else None)
            out.append([p.grad.clone() for p in part.parameters()])
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        part.zero_grad(set_to_none=True)
    return out


def test_a_float_mask_passed_on_arrives_without_a_gradient_in_every_mode() -> None:
    parts = _parts(False)
    d, y = _data()
    nn.functional.mse_loss(parts[1](parts[0](d)), y).backward()
    for checkpoint in ("never", "except_last", "always"):
        for rank, steps in enumerate(spawn(_run, 2, args=(checkpoint, False), timeout=90)):
            for grads in steps:
                assert not isinstance(grads, str), (checkpoint, rank, grads)
                for got, want in zip(grads, parts[rank].parameters(), strict=True):
                    assert want.grad is not None
                    torch.testing.assert_close(got, want.grad, rtol=1e-13, atol=1e-15)


def test_a_checkpointed_stage_changing_its_input_in_place_is_refused_on_every_rank() -> None:
    for checkpoint in ("except_last", "always"):
        for rank, steps in enumerate(spawn(_run, 2, args=(checkpoint, True), timeout=90)):
            for text in steps:
                assert isinstance(text, str), (checkpoint, rank, text)
                assert text.startswith(
                    "RankError: rank 1: 1F0 failed: RuntimeError: 1F0: stage 1's forward "
                    "changed its input in place (tensor leaf 1 of the input, shape (4,), "
                    f"torch.float64): with checkpoint={checkpoint!r} this forward runs again"
                ), (checkpoint, rank, text)
    # Without recomputation the change is the model's own: the same as in one process.
    parts = _parts(True)
    d, y = _data()
    nn.functional.mse_loss(parts[1](parts[0](d)), y).backward()
    for rank, steps in enumerate(spawn(_run, 2, args=("never", True), timeout=90)):
        for got, want in zip(steps[0], parts[rank].parameters(), strict=True):
            assert want.grad is not None
            torch.testing.assert_close(got, want.grad, rtol=1e-13, atol=1e-15)
