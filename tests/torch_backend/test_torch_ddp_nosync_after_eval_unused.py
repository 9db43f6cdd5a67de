"""A ``no_sync`` pass through other parameters than the validation pass before it, on gloo.

``find_unused_parameters``, a model of a shared layer and two branches. Every rank runs a
validation forward pass through both branches with gradients on and no backward: the
reducer stays prepared for it (PyTorch's does), expecting every parameter. The next
``no_sync`` pass goes through one branch only: PyTorch's reducer takes its gradients,
never finishes the reduction and leaves ``.grad`` as it is (each rank's own; under
``gradient_as_bucket_view`` copied into the bucket views, divided by the world size), and
its next forward pass raises the "prior iteration" error, at every step from then on.
xgrad's set every ``.grad`` of that pass to None. Now, after every backward pass up to
PyTorch's first error, each rank's ``.grad`` is PyTorch's bit for bit, and the error is
PyTorch's at the same pass; xgrad then recovers: the steps after give both ranks' mean
gradient. One bucket (a launched bucket's reduction lands in PyTorch's views whenever it
completes, so its ``.grad`` differs from run to run there), the pass in the first
iteration or after a step, one or two ``no_sync`` passes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from branches import Branches

from xgrad.torch_backend.spawn import spawn

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
#: the no_sync passes of the first step after the validation pass, by case name.
PASSES = {"a": ("a",), "b": ("b",), "a_then_b": ("a", "b")}


def _steps(passes: tuple[str, ...]) -> list[list[tuple[str, bool]]]:
    """Three steps after the validation pass: ``passes`` under no_sync then a
    synchronised one through both branches, then twice one through ``a`` and that."""
    last = [("ab", True)]
    return [[(b, False) for b in passes] + last, [("a", False), *last], [("a", False), *last]]


def _run(rank: int, cls: Any, passes: tuple[str, ...], view: bool, first: bool) -> list[Any]:
    """Every backward pass's ``.grad`` (None where absent) or its error's text."""
    torch.manual_seed(0)
    model = Branches()
    options = {"timeout": 10.0} if cls.__module__.startswith("xgrad") else {}
    ddp = cls(model, find_unused_parameters=True, gradient_as_bucket_view=view, **options)
    g = torch.Generator().manual_seed(7 + rank)
    out: list[Any] = []

    def backward(branch: str, sync: bool) -> None:
        x = torch.randn(5, 4, generator=g)
        try:
            if sync:
                ddp(x, branch).pow(2).mean().backward()
            else:
                with ddp.no_sync():
                    ddp(x, branch).pow(2).mean().backward()
            out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {str(exc)[:60]}")

    if not first:
        model.zero_grad()
        backward("ab", True)
    model.zero_grad()
    ddp(torch.randn(5, 4, generator=g), "ab").pow(2).mean()  # validation, every rank
    for step in _steps(passes):
        model.zero_grad()
        for branch, sync in step:
            backward(branch, sync)
    return out


def _mean(rank: int, passes: tuple[str, ...], first: bool, step: int) -> list[torch.Tensor]:
    """Step ``step``'s gradients (after the validation pass), both ranks' mean, as one
    process computes them (the same inputs, drawn the same way)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Branches()
    g = torch.Generator().manual_seed(7 + rank)
    drawn = (0 if first else 1) + 1 + sum(len(s) for s in _steps(passes)[:step])
    for _ in range(drawn):
        torch.randn(5, 4, generator=g)
    for branch, _ in _steps(passes)[step]:
        model(torch.randn(5, 4, generator=g), branch).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for t in grads:
        dist.all_reduce(t)
        t /= 2
    return grads


def _compare(rank: int, world: int) -> dict[str, Any]:
    import warnings

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    warnings.simplefilter("ignore")
    found: dict[str, Any] = {}
    for name, passes in PASSES.items():
        for view in (False, True):
            for first in (True, False):
                theirs = _run(rank, TorchDDP, passes, view, first)
                ours = _run(rank, DistributedDataParallel, passes, view, first)
                key = f"{name}-{'view' if view else 'copy'}-{'first' if first else 'later'}"
                found[key] = _check(rank, theirs, ours, passes, first)
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b, strict=True)
    )


def _check(
    rank: int, theirs: list[Any], ours: list[Any], passes: tuple[str, ...], first: bool
) -> Any:
    """True, or what went wrong: up to PyTorch's first error every record equal (the
    error's text too), and the last two steps' gradients the ranks' mean."""
    raised = next((i for i, t in enumerate(theirs) if isinstance(t, str)), len(theirs))
    assert raised < len(theirs), "PyTorch's run raised nowhere: not the case under test"
    for i in range(raised + 1):
        if not _same(theirs[i], ours[i]):
            return f"backward pass {i}: PyTorch's {_show(theirs[i])}, xgrad's {_show(ours[i])}"
    for step in (1, 2):
        got = ours[sum(len(s) for s in _steps(passes)[: step + 1]) - 1 + (0 if first else 1)]
        want = _mean(rank, passes, first, step)
        if isinstance(got, str) or not all(
            torch.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(got, want, strict=True)
        ):
            return f"step {step} after the error: {_show(got)}, not the ranks' mean"
    return True


def _show(record: Any) -> str:
    if isinstance(record, str):
        return record
    return "".join("N" if t is None else "g" for t in record)


@pytest.fixture(scope="module")
def compared() -> list[dict[str, Any]]:
    return spawn(_compare, 2, timeout=300)


@pytest.mark.parametrize("passes", list(PASSES))
@pytest.mark.parametrize("view", ["copy", "view"])
@pytest.mark.parametrize("first", ["first", "later"])
def test_gradients_are_pytorchs_until_its_error_then_the_ranks_mean(
    compared: list[dict[str, Any]], passes: str, view: str, first: str
) -> None:
    key = f"{passes}-{view}-{first}"
    assert all(compared[rank][key] is True for rank in range(2)), [r[key] for r in compared]
