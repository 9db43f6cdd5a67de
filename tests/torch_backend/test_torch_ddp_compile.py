"""``torch.compile`` of xgrad's DDP: equal to compiled PyTorch DDP, reducer still in charge.

The model's parameters exceed ``bucket_bytes_cap`` several times over, so dynamo's
``DDPOptimizer`` splits the graph; a counting backend shows the split (and its absence
with ``optimize_ddp=False``), and the reducer's records show it drove every iteration.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class Mlp(nn.Module):
    """Defined here, not an ``nn.Sequential``: dynamo compiles user code, not torch's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 512)
        self.b = nn.Linear(512, 512)
        self.c = nn.Linear(512, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Mlp()


def _compiled_run(rank: int, world: int, backend: str) -> dict[str, Any]:
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    base = _model()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(4, 3)
    grads: dict[str, list[list[torch.Tensor]]] = {}
    out: dict[str, Any] = {}
    for name, cls in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        ddp = cls(model, bucket_cap_mb=1)
        compiled = torch.compile(ddp, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads[name] = []
        for _ in range(3):
            opt.zero_grad()
            ((compiled(x) - y) ** 2).mean().backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
            opt.step()
        if name == "xgrad":
            out["iterations"] = ddp.statistics()["iterations"]
            out["ready"] = len(ddp.statistics()["ready_order"])
    out["equal"] = all(
        torch.equal(a, b)
        for mine, ref in zip(grads["xgrad"], grads["torch"], strict=True)
        for a, b in zip(mine, ref, strict=True)
    )
    if backend == "aot_eager":
        out["graphs"] = {flag: _count_graphs(rank, flag) for flag in (True, False)}
    return out


def _count_graphs(rank: int, optimize_ddp: bool) -> int:
    """How many graphs dynamo hands the backend for one compiled forward of xgrad's DDP."""
    import torch._dynamo

    from xgrad.torch_backend import DistributedDataParallel

    count = 0

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        nonlocal count
        count += 1
        return gm.forward

    torch._dynamo.reset()
    old = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=1)
        torch.compile(ddp, backend=counting)(torch.randn(4, 6)).sum().backward()
    finally:
        torch._dynamo.config.optimize_ddp = old
    return count


def test_compiled_aot_eager_equals_compiled_pytorch_ddp() -> None:
    for r in spawn(_compiled_run, 2, args=("aot_eager",), timeout=240):
        assert r["equal"]
        assert r["iterations"] == 3  # xgrad's reducer reduced every compiled step
        assert r["ready"] == 6
        # DDPOptimizer split the graph at bucket_bytes_cap; without it, one graph.
        assert r["graphs"][True] > 1
        assert r["graphs"][False] == 1


@pytest.mark.slow
def test_compiled_inductor_equals_compiled_pytorch_ddp() -> None:
    for r in spawn(_compiled_run, 2, args=("inductor",), timeout=480):
        assert r["equal"]
        assert r["iterations"] == 3


def _compiled_autograd(rank: int, world: int) -> list[str]:
    from torch._dynamo import compiled_autograd

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    x = torch.ones(3, 4) * (rank + 1)
    out = []
    for how in ("enable", "config"):
        try:
            if how == "enable":
                loss = ddp(x).sum()
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                torch._dynamo.config.compiled_autograd = True
                try:

                    @torch.compile(backend="eager")
                    def step(inp: torch.Tensor) -> None:
                        ddp(inp).sum().backward()

                    step(x)
                finally:
                    torch._dynamo.config.compiled_autograd = False
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_compiled_autograd_is_refused_with_a_clear_error() -> None:
    """It failed inside dynamo ("queue_callback() is only supported when Compiled Autograd
    is enabled with fullgraph=True"); PyTorch's C++ reducer refuses it by name too."""
    for texts in spawn(_compiled_autograd, 2, timeout=240):
        for text in texts:
            assert text.startswith(
                "Compiled autograd is not compatible with xgrad's DistributedDataParallel"
            ), text
