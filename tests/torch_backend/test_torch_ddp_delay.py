"""``delay_all_reduce_named_params`` when the hooked gradient comes before a delayed one.

A layer's bias hooked and its weight delayed: autograd computes the bias's gradient
first, so PyTorch's DDP reduces the delayed buffer before the weight's gradient is in
it (its result then races with the accumulation: the ranks keep different, unaveraged
gradients without an error). xgrad's reduces it at the end of the pass instead, once
every delayed gradient came: on two gloo ranks, the weight's gradient is the mean of
the ranks' own, on both, pass after pass.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn
from two_layers import TwoLayers

from xgrad.torch_backend.spawn import spawn


def _delayed_first(rank: int, world: int, dtype: torch.dtype = torch.float32) -> list[float]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    model, local = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(
        model,
        delay_all_reduce_named_params=[("0.weight", model[0].weight)],
        param_to_hook_all_reduce=model[0].bias,
    )
    errors = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(dtype)
        for m in (ddp, local):
            m.zero_grad(set_to_none=step % 2 == 0)
            m(x).square().sum().backward()
        mine = local[0].weight.grad
        assert mine is not None and model[0].weight.grad is not None
        every: list[Any] = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        mean = sum(every) / world
        errors.append(float((model[0].weight.grad - mean).abs().max()))
    return errors


def test_a_delayed_gradient_after_the_hooked_one_is_still_averaged() -> None:
    for errors in spawn(_delayed_first, 2, timeout=60):
        assert max(errors) < 1e-6, errors


def test_a_float64_module_s_delayed_gradients_are_averaged() -> None:
    # The buffer follows the delayed parameters' dtype: made in the default dtype (as
    # PyTorch's), a float64 module's delayed gradients could not be views of it, and since
    # the check of converted modules its first forward pass was refused.
    for errors in spawn(_delayed_first, 2, args=(torch.float64,), timeout=60):
        assert max(errors) < 1e-12, errors


def _converted(rank: int, world: int, part: bool) -> list[str]:
    """The module (or the delayed layer alone, ``part``) converted to float64 at step 1,
    not through the DDP: per step, what the pass raised ("" when nothing), or "unequal"
    where the delayed gradient differs between the ranks."""
    import time

    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = TwoLayers()
    ddp = DistributedDataParallel(
        model,
        delay_all_reduce_named_params=[("a.weight", model.a.weight)],
        param_to_hook_all_reduce=model.b.weight,
        timeout=20,
    )
    out = []
    for step in range(4):
        if step == 1:
            (model.a if part else model).double()
        ddp.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        start = time.monotonic()
        try:
            y = ddp(x.to(model.a.weight.dtype))
            y.to(torch.float32).square().sum().backward()
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            grad = model.a.weight.grad
            assert grad is not None
            every: list[Any] = [torch.zeros_like(grad) for _ in range(world)]
            dist.all_gather(every, grad)
            out.append("" if torch.equal(every[0], every[1]) else "unequal")
        assert time.monotonic() - start < 10.0, out  # never the DDP's timeout
    return out


@pytest.mark.parametrize("part", [False, True])
def test_delayed_parameters_converted_behind_the_ddp_s_back_are_refused_on_every_rank(
    part: bool,
) -> None:
    """``ddp.module.double()`` converts the delayed gradients out of the buffer that is
    reduced: each rank kept its own, without a word (PyTorch 2.13 too). Every rank now
    refuses the step at its forward pass, naming the parameter and both dtypes."""
    results: Any = spawn(_converted, 2, args=(part,), timeout=90)
    named = re.compile(
        r"parameter a\.weight in delay_all_reduce_named_params is torch\.float64 but the "
        r"buffer it is reduced in holds torch\.float32 on rank [01]: .*Convert the module "
        "before constructing DistributedDataParallel"
    )
    for rank, errors in enumerate(results):
        assert errors[0] == "", (rank, errors)
        for error in errors[1:]:
            assert error.startswith("RankError[GradientDtypeError]: rank "), (rank, error)
            assert named.search(error), (rank, error)
