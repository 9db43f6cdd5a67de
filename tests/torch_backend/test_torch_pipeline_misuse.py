"""Misuse of a pipeline step is named where it starts, and the next step works.

On two gloo ranks: a ``loss_fn`` that returns a Python number (was "AttributeError:
'float' object has no attribute 'detach'"), targets whose batch does not match the
inputs' (was a bare broadcast error; now with both shapes), and a step under
``torch.no_grad()`` (failed only at the last microbatch's backward, after the others had
added to ``.grad``; now refused before any pass), and a loss that is not a scalar, does
not require a gradient or is an integer (autograd's words in the backward; now named at
the forward that made it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn


def _misuse(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(rank)
    stage = nn.Linear(3, 3).double()
    out: dict[str, Any] = {}
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def attempt(name: str, loss: Any, targets: Any, *, grad: bool = True, inputs: Any = x) -> None:
        rt = PipelineRuntime(xp.make("1f1b", 2, 2), [stage], loss, timeout=20)
        stage.zero_grad(set_to_none=True)
        try:
            with torch.set_grad_enabled(grad):
                rt.step(inputs if rank == 0 else None, targets if rank == 1 else None)
            out[name] = "no error"
        except Exception as exc:
            out[name] = str(exc)
        out[name + " grad"] = stage.weight.grad is not None
        rt = PipelineRuntime(xp.make("1f1b", 2, 2), [stage], nn.functional.mse_loss, timeout=20)
        rt.step(x if rank == 0 else None, y if rank == 1 else None)  # the next step works
        out[name + " next"] = stage.weight.grad is not None

    attempt("number", lambda a, b: 3.0, y)
    attempt("targets", nn.functional.mse_loss, torch.randn(6, 3, dtype=torch.float64))
    # Twice the inputs' rows: mse_loss broadcasts (1, 3) against (2, 3) with a warning only.
    attempt("broadcast", nn.functional.mse_loss, y, inputs=x[:2])
    attempt("no_grad", nn.functional.mse_loss, y, grad=False)
    attempt("vector", lambda a, b: (a - b).pow(2).mean(0), y)
    attempt("detached", lambda a, b: nn.functional.mse_loss(a, b).detach(), y)
    attempt("integer", lambda a, b: torch.tensor(3), y)
    return out


def test_misuse_of_a_step_is_named_and_the_next_step_works() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = spawn(_misuse, 2, timeout=90)
    for rank, out in enumerate(results):
        assert "loss_fn returned a float (3.0), not a tensor" in out["number"], out
        assert "loss_fn(output, target)" in out["targets"], out
        assert "output shape (2, 3); target shape (3, 3)" in out["targets"], out
        assert (
            "the microbatch's output has 1 rows and its target 2: inputs and targets must "
            "have the same batch size (output shape (1, 3); target shape (2, 3))"
        ) in out["broadcast"], out
        assert f"rank {rank}: step() runs the backward pass too" in out["no_grad"], out
        assert not out["no_grad grad"], out  # refused before any pass
        # Was autograd's words in the backward ("grad can be implicitly created only for
        # scalar outputs", "element 0 of tensors does not require grad").
        assert (
            "rank 1: 1F0 failed: ValueError: loss_fn must return a scalar, got shape (3,)"
            in (out["vector"])
        ), out
        assert "loss_fn returned a loss that does not require a gradient" in out["detached"]
        assert "loss_fn must return a floating-point scalar, got torch.int64" in out["integer"]
        kinds = ("number", "targets", "broadcast", "no_grad", "vector", "detached", "integer")
        assert all(out[f"{k} next"] for k in kinds), out


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str fails")


class _RaisesOnce(nn.Module):
    def __init__(self, arm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).double()
        self.arm = arm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.arm:
            self.arm = False
            raise _Unprintable()
        return torch.tanh(self.fc(x))


def _unprintable(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    runtime = PipelineRuntime(
        xp.make("gpipe", world, 2), [_RaisesOnce(rank == 1)], nn.functional.mse_loss, timeout=20
    )
    out = []
    for _ in range(2):
        try:
            runtime.step(x if rank == 0 else None, y if rank == world - 1 else None)
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_an_exception_that_cannot_be_printed_is_still_posted() -> None:
    # Formatting it for the channel raised on the failing rank, which then raised a bare
    # RuntimeError; the others waited out the timeout and named it "did not answer", and
    # the next step failed too.
    for rank, (first, second) in enumerate(spawn(_unprintable, 2, timeout=120)):
        assert first.startswith("RankError") and "rank 1: 1F0 failed: _Unprintable: <str()" in (
            first
        ), (rank, first)
        assert second == "ok", (rank, second)
