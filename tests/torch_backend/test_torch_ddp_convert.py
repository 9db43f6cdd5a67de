"""A DDP converted after it was made (``ddp.double()``) reduces in the new dtype.

The buckets kept the dtype they were made with: float64 gradients went through float32
buckets, on every later step (about 5e-9 off the mean; the first iteration's rebuild
hid it when the conversion came before any step). PyTorch's DDP leaves each rank its
local gradient then, without a word. On two gloo ranks (dividing by two is exact, so the
mean of the local gradients is the reduced one bit for bit).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from two_layers import TwoLayers

from xgrad.torch_backend.spawn import spawn

STEPS = 4


def _run(rank: int, world: int, when: int, view: bool) -> list[float]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=view, timeout=20)
    errors = []
    for step in range(STEPS):
        if step == when:
            ddp.double()
        dtype = torch.float64 if step >= when else torch.float32
        model.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(5, 6, dtype=dtype, generator=g)
        ddp(x).pow(2).mean().backward()
        local = copy.deepcopy(model)
        local.zero_grad()
        local(x).pow(2).mean().backward()
        worst = 0.0
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert p.grad.dtype == dtype
            mean = q.grad.clone()
            dist.all_reduce(mean)
            mean /= world
            worst = max(worst, float((p.grad - mean).abs().max()))
        errors.append(worst)
    return errors


@pytest.mark.parametrize(("when", "view"), [(0, False), (2, False), (2, True)])
def test_gradients_are_reduced_in_the_dtype_the_parameters_have(when: int, view: bool) -> None:
    results: Any = spawn(_run, 2, args=(when, view), timeout=90)
    for errors in results:
        assert errors == [0.0] * STEPS, errors


def _powersgd(rank: int, world: int) -> list[str]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(model, timeout=20)
    state = ps.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
        min_compression_rate=0.5, warm_start=True, use_error_feedback=True,
    )  # fmt: skip
    ddp.register_comm_hook(state, ps.powerSGD_hook)
    out = []
    for step in range(5):
        if step == 3:
            ddp.double()
        dtype = next(model.parameters()).dtype
        model.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x.to(dtype)).pow(2).mean().backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()]).double()  # type: ignore[union-attr]
        total = flat.clone()
        dist.all_reduce(total)
        out.append(f"{dtype} {'equal' if torch.equal(2 * flat, total) else 'differ'}")
    return out


def test_powersgd_s_memories_start_again_after_a_conversion() -> None:
    """PowerSGD keeps per-bucket memories (error feedback, warm start) in the buckets'
    dtype: after the buckets were made again in float64 every step raised "expected
    scalar type Double but found Float". They start again now, every rank alike."""
    results: Any = spawn(_powersgd, 2, timeout=90)
    want = ["torch.float32 equal"] * 3 + ["torch.float64 equal"] * 2
    assert results == [want, want], results


def _behind_its_back(
    rank: int, world: int, when: int, view: bool, part: bool, static: bool
) -> list[str]:
    """The module (or its second layer, ``part``) converted to float64 at step ``when``,
    not through the DDP: per step, what it raised ("" when nothing)."""
    import time

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = TwoLayers()
    ddp = DistributedDataParallel(
        model, gradient_as_bucket_view=view, static_graph=static, timeout=20
    )
    out = []
    for step in range(when + 2):
        if step == when:
            (model.b if part else model).double()
        model.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        start = time.monotonic()
        try:
            ddp(x.to(model.a.weight.dtype)).pow(2).mean().backward()
            out.append("")
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        assert time.monotonic() - start < 10.0, out  # never the DDP's timeout
    return out


@pytest.mark.parametrize(
    ("when", "view", "part", "static"),
    [
        (0, False, False, False),
        (0, True, False, False),
        (2, False, False, False),
        (2, True, False, False),
        (2, False, True, False),
        (0, False, False, True),
    ],
)
def test_a_module_converted_behind_the_ddp_s_back_is_refused_on_every_rank(
    when: int, view: bool, part: bool, static: bool
) -> None:
    """``ddp.module.double()`` (or of one submodule) goes round the DDP: its float64
    gradients went through the float32 buckets and came back rounded, without a word.
    As PyTorch's reducer, every rank now refuses them at the conversion's first step and
    at every step after, naming the parameter and both dtypes."""
    results: Any = spawn(_behind_its_back, 2, args=(when, view, part, static), timeout=90)
    named = re.compile(
        rf"with name {'b' if part else '[ab]'}\.(weight|bias) is torch\.float64 but its "
        r"bucket holds torch\.float32 on rank [01]: .*Convert the module before "
        "constructing DistributedDataParallel"
    )
    for rank, errors in enumerate(results):
        assert errors[:when] == [""] * when, (rank, errors)
        for error in errors[when:]:
            # A rank's own refusal, or (under load) its peer's read first, relayed.
            assert error.startswith(("RankError[GradientDtypeError]: rank ", "RankError: rank ")), (
                rank,
                error,
            )
            assert named.search(error), (rank, error)


def _mixed_converted(rank: int, world: int, how: str) -> list[str]:
    """Mixed precision (float16 compute), the module converted at step 1 not through the
    DDP (``how``: "double", "half", or "part": the second layer's .double()): per step,
    what it raised ("" when nothing) or, when nothing, the second layer's dtype."""
    import time

    from torch.nn.parallel.distributed import _MixedPrecision

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = TwoLayers()
    ddp = DistributedDataParallel(
        model, mixed_precision=_MixedPrecision(param_dtype=torch.float16), timeout=20
    )
    out = []
    for step in range(4):
        if step == 1:
            target = model.b if how == "part" else model
            target.half() if how == "half" else target.double()
        model.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        start = time.monotonic()
        try:
            ddp(x).float().pow(2).mean().backward()
            out.append("" if step == 0 else str(model.b.weight.dtype))
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        assert time.monotonic() - start < 10.0, out  # never the DDP's timeout
    return out


@pytest.mark.parametrize("how", ["double", "half", "part"])
def test_a_module_converted_behind_a_mixed_precision_ddp_s_back_is_refused(how: str) -> None:
    """Under ``mixed_precision`` the DDP keeps the full-precision tensors and points the
    parameters back at them after every backward pass: ``ddp.module.double()`` was undone
    without a word (float32 again after the step). Every rank now refuses it at the next
    forward pass, naming the parameter and both dtypes."""
    results: Any = spawn(_mixed_converted, 2, args=(how,), timeout=90)
    dtype = "float16" if how == "half" else "float64"
    named = re.compile(
        rf"Parameter {'b' if how == 'part' else '[ab]'}\.(weight|bias) is torch\.{dtype} "
        r"but mixed_precision keeps it in torch\.float32 on rank [01]: .*Convert the "
        "module before constructing DistributedDataParallel"
    )
    for rank, errors in enumerate(results):
        assert errors[0] == "", (rank, errors)
        for error in errors[1:]:
            # A rank's own refusal, or (under load) its peer's read first, relayed.
            assert error.startswith(("RankError[GradientDtypeError]: rank ", "RankError: rank ")), (
                rank,
                error,
            )
            assert named.search(error), (rank, error)
