"""A comm hook reading ``p.grad`` under ``gradient_as_bucket_view``, from the first step on.

PyTorch 2.13's reducer copies a gradient that is not yet its bucket's view into the view
when it is marked ready (divided by the world size unless a hook is registered) and
points ``param.grad`` at the view then, before the bucket's hook runs: a hook that reads
``p.grad`` for ``p in bucket.parameters()`` sees the bucket's view and its values on the
first step too, and on every step whose gradients were set to None. xgrad pointed the
gradients at their views at the end of the pass, so in the first step's hook (and after
``zero_grad()``) ``p.grad`` was the gradient autograd made, not the view (same values and
final gradients). Run on two gloo ranks, the same recording hook under both DDPs gives
the same records, bit for bit: each parameter's aliasing of the bucket's buffer and
``p.grad``'s values, when the hook is called and when its reduction completed, under
PyTorch's ``allreduce_hook`` (it divides) and a user's hook that sums (none divides before
it: a registered hook does), with gradients kept or set to None before each step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from xgrad.torch_backend.spawn import spawn

STEPS = 3


def _shares(grad: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    return grad is not None and grad.untyped_storage().data_ptr() == (
        buffer.untyped_storage().data_ptr()
    )


def _summed(state, bucket):  # type: ignore[no-untyped-def]
    """A user's hook that sums (divides by nothing). Unannotated, as the hook below:
    PyTorch's check refuses this module's (postponed) annotations."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _records(rank: int, world: int, hook_name: str, set_to_none: bool) -> list[list[Any]]:
    """Per DDP (PyTorch's, then xgrad's): per step, the hook's records sorted by (when,
    bucket), and the final gradients."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    inner = {"allreduce": allreduce_hook, "summed": _summed}[hook_name]
    return [_steps(cls, rank, inner, set_to_none) for cls in (TorchDDP, DistributedDataParallel)]


def _steps(cls: Any, rank: int, inner: Any, set_to_none: bool) -> list[Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    # One bucket in the first step (PyTorch's small first one), two after the rebuild.
    ddp = cls(model, gradient_as_bucket_view=True, bucket_cap_mb=40 / 2**20)
    # By (when, bucket): the buckets' reductions complete in no set order.
    seen: dict[tuple[str, int], list[Any]] = {}

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        params = bucket.parameters()

        def record(when: str) -> None:
            seen[when, bucket.index()] = [
                (_shares(p.grad, buffer), None if p.grad is None else p.grad.detach().clone())
                for p in params
            ]

        record("called")

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            record("reduced")
            return f.value()

        return inner(state, bucket).then(done)

    ddp.register_comm_hook(None, hook)
    g = torch.Generator().manual_seed(1 + rank)
    steps = []
    for _ in range(STEPS):
        if set_to_none:
            ddp.zero_grad(set_to_none=True)
        seen.clear()
        ddp(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        final = [p.grad.clone() for p in model.parameters()]
        steps.append((sorted(seen.items(), key=lambda item: item[0]), final))
    return steps


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("set_to_none", [False, True], ids=["kept", "set_to_none"])
@pytest.mark.parametrize("hook_name", ["allreduce", "summed"])
def test_a_hook_sees_the_bucket_views_as_pytorchs_from_the_first_step(
    hook_name: str, set_to_none: bool
) -> None:
    for theirs, ours in spawn(_records, 2, args=(hook_name, set_to_none), timeout=90):
        for step in range(STEPS):
            assert _same(theirs[step], ours[step]), (step, theirs[step], ours[step])
        # PyTorch's: the hook saw the bucket's views on every step.
        flags = {flag for seen, _ in theirs for _, records in seen for flag, _ in records}
        assert flags == {True}, theirs
