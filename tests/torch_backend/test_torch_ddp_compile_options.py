"""``torch.compile`` of xgrad's DDP under its options, gradients equal to compiled PyTorch DDP.

The compile test next to this one runs the default settings; a user who compiles a DDP
also sets ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
accumulates under ``no_sync`` or registers a comm hook, each of which takes another path
through the reducer while dynamo's ``DDPOptimizer`` splits the graph at the bucket cap.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class Branches(nn.Module):
    """Two heads; with ``find_unused_parameters`` every other step uses the second alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 512)
        self.b = nn.Linear(512, 512)
        self.c = nn.Linear(512, 3)
        self.u = nn.Linear(512, 3)

    def forward(self, x: torch.Tensor, use_u: bool = False) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.u(h) if use_u else self.c(h)


def _grads(ddp_cls: Any, base: nn.Module, rank: int, options: dict[str, Any]) -> list[Any]:
    import torch._dynamo
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch._dynamo.reset()
    model = copy.deepcopy(base)
    kwargs = {k: v for k, v in options.items() if k not in ("no_sync", "hook")}
    ddp = ddp_cls(model, bucket_cap_mb=1, **kwargs)
    if options.get("hook"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    compiled = torch.compile(ddp, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        use_u = bool(options.get("find_unused_parameters")) and step % 2 == 1
        opt.zero_grad()
        if options.get("no_sync"):
            with ddp.no_sync():
                compiled(x, use_u).sum().backward()
        compiled(x, use_u).pow(2).mean().backward()
        out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return out


def _compare(rank: int, world: int, cases: list[dict[str, Any]]) -> list[bool]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = Branches()
    equal = []
    for options in cases:
        mine = _grads(DistributedDataParallel, base, rank, options)
        ref = _grads(TorchDDP, base, rank, options)
        equal.append(
            all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for ms, rs in zip(mine, ref, strict=True)
                for a, b in zip(ms, rs, strict=True)
            )
        )
    return equal


def test_compiled_ddp_options_equal_compiled_pytorch_ddp() -> None:
    cases: list[dict[str, Any]] = [
        {"find_unused_parameters": True, "gradient_as_bucket_view": True, "no_sync": True},
        {"static_graph": True, "hook": True},
    ]
    for equal in spawn(_compare, 2, args=(cases,), timeout=300):
        assert equal == [True, True]
