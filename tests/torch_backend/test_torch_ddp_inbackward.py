"""Optimizers applied in the backward pass under xgrad's DDP, against PyTorch's DDP.

``_apply_optimizer_in_backward`` steps each parameter from its gradient hook. Under DDP
that must be the averaged gradient (PyTorch's DDP takes the hooks over at its first
forward pass; its version needs an accelerator, so the reference here is PyTorch's DDP
with the same optimizer stepped after ``backward()``): the parameters must equal it bit
for bit after every step, on every rank, and the in-backward parameters' ``.grad`` is
``None`` after the pass, as PyTorch documents.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

WORLD = 2
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _optimizer(params: Any, adam: bool) -> torch.optim.Optimizer:
    if adam:
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _in_backward(rank: int, adam: bool, part: bool, **kw: Any) -> list[Any]:
    from torch.distributed.optim import _apply_optimizer_in_backward

    from xgrad.torch_backend import DistributedDataParallel

    model = _model()
    params = list(model.parameters())
    stepped = params[:2] if part else params  # part: the first layer only, the rest after
    _apply_optimizer_in_backward(
        type(_optimizer(params, adam)), stepped, _optimizer(params, adam).defaults
    )
    ddp = DistributedDataParallel(model, **kw)
    rest = [p for p in params if all(p is not q for q in stepped)]
    opt = _optimizer(rest, adam) if rest else None
    seen = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        ((ddp(x) - y) ** 2).sum().backward()
        grads_none = [p.grad is None for p in stepped]
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen.append((grads_none, [p.detach().clone() for p in params]))
    return seen


def _reference(rank: int, adam: bool, **kw: Any) -> list[Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = _model()
    ddp = TorchDDP(model, **kw)
    opt = _optimizer(model.parameters(), adam)
    seen = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        ((ddp(x) - y) ** 2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


CASES: dict[str, tuple[bool, bool, dict[str, Any]]] = {
    "sgd": (False, False, {}),
    "adam": (True, False, {}),
    "sgd_small_buckets": (False, False, {"bucket_cap_mb": 0.0005}),
    "sgd_grad_views": (False, False, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}),
    "first_layer_only": (False, True, {"bucket_cap_mb": 0.0005}),
}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (adam, part, kw) in CASES.items():
        out[name] = (_in_backward(rank, adam, part, **kw), _reference(rank, adam, **kw))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_in_backward_optimizers_step_on_the_averaged_gradient(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank, by_name in enumerate(results):
        ours, theirs = by_name[name]
        for step, ((grads_none, params), ref) in enumerate(zip(ours, theirs, strict=True)):
            assert all(grads_none), f"{name}, rank {rank}, step {step}: .grad kept"
            for i, (a, b) in enumerate(zip(params, ref, strict=True)):
                assert torch.equal(a, b), f"{name}, rank {rank}, step {step}, parameter {i}"


def test_a_comm_hook_and_in_backward_optimizers_are_refused_as_in_pytorch() -> None:
    spawn(_refused, WORLD, timeout=60)


def _refused(rank: int, world: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import _apply_optimizer_in_backward

    from xgrad.torch_backend import DistributedDataParallel

    model = _model()
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="can only be called once"):
        ddp(torch.randn(2, 6))
