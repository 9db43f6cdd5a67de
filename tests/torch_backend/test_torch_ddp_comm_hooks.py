"""Communication hooks on the DDP: PyTorch's built-in hook types, the future adapter's checks.

In process: the built-in types map to PyTorch's Python twins and an unknown one is named;
a hook that is not callable, or returns something other than a future, is named; a
channels_last gradient reaches the hook as a row-major view of the bucket. One run of two
gloo ranks: ``_register_builtin_comm_hook(FP16_COMPRESS)`` on xgrad's DDP gives PyTorch's
DDP's gradients with the same built-in hook, step by step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from xgrad.reducer import GradBucket
from xgrad.torch_backend.ddp_comm_hooks import (
    _row_major,
    builtin_hook,
    callbacks_compute_only,
    future_hook,
)
from xgrad.torch_backend.spawn import spawn


def test_builtin_hook_types_are_pytorchs_python_hooks_and_others_are_named() -> None:
    assert builtin_hook(dist.BuiltinCommHookType.ALLREDUCE) is default_hooks.allreduce_hook
    assert builtin_hook(dist.BuiltinCommHookType.FP16_COMPRESS) is default_hooks.fp16_compress_hook
    with pytest.raises(ValueError, match=r"comm_hook_type='BF16' is not one of"):
        builtin_hook("BF16")


def _bucket(*grads: torch.Tensor) -> GradBucket[torch.Tensor]:
    flat = torch.cat([g.reshape(-1) for g in grads])
    return GradBucket(0, flat, list(grads), [None] * len(grads), True)


def test_a_hook_that_is_not_callable_or_returns_no_future_is_named() -> None:
    with pytest.raises(TypeError, match="Communication hook must be callable, got 3"):
        future_hook(lambda: None, 3, None)  # type: ignore[arg-type]

    def tensor_hook(state: Any, bucket: Any) -> Any:
        return bucket.buffer()

    run = future_hook(lambda: None, tensor_hook, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tensor_hook returned Tensor, expected torch\.futures"):
        run(_bucket(torch.ones(3)))


def test_a_channels_last_gradient_reaches_the_hook_row_major() -> None:
    grad = torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)
    bucket = _bucket(torch.ones(2), grad)
    seen = _row_major(bucket).gradients()
    assert all(g.is_contiguous() for g in seen)
    assert seen[1].data_ptr() == bucket.buffer()[2:].data_ptr()  # a view, not a copy
    plain = _bucket(torch.ones(2), torch.ones(2, 3))
    assert _row_major(plain) is plain  # row-major already: the bucket itself


def _builtin_fp16(rank: int, world: int) -> bool:
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    # a bucket per parameter: the buckets' hooks overlap on gloo (PyTorch's own hook)
    cap = 1e-5
    ours, theirs = (
        DistributedDataParallel(model, bucket_cap_mb=cap),
        TorchDDP(ref, bucket_cap_mb=cap),
    )
    ours._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    theirs._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert not ours.reducer.serial_hooks
    g = torch.Generator().manual_seed(rank)
    equal = True
    for _ in range(3):
        x = torch.randn(4, 5, generator=g)
        for m, d in ((model, ours), (ref, theirs)):
            m.zero_grad()
            d(x).square().sum().backward()
        equal &= all(
            torch.equal(p.grad, q.grad)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    return equal


def test_only_pytorchs_compute_only_hooks_overlap_on_gloo() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    for hook in (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
    ):
        assert callbacks_compute_only(hook)
    for hook in (
        powerSGD_hook.powerSGD_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        lambda state, bucket: default_hooks.allreduce_hook(state, bucket),
    ):
        assert not callbacks_compute_only(hook)


def test_a_builtin_hook_gives_pytorchs_gradients() -> None:
    assert spawn(_builtin_fp16, 2, timeout=60) == [True, True]
