"""Reentrant checkpointing under DDP: xgrad's gradients equal PyTorch's DDP's, bit for bit.

A DDP ends its pass with a callback queued at the pass's first gradient hook. With the
last layer checkpointed (``use_reentrant=True``), that hook runs inside the checkpoint's
own backward call, whose graph task ended before the first layer's gradients came: the
pass was finalized without them (``.grad`` None at step 0, PyTorch's "prior iteration"
error at every later step), and a ``no_sync`` pass was marked done as early. PyTorch's
reducer ends the pass at its last bucket. On 2 real gloo ranks, 3 steps, the last, the
middle or the first layer checkpointed, synchronised or accumulating under ``no_sync``
first, with ``static_graph`` and ``gradient_as_bucket_view``. With
``find_unused_parameters`` PyTorch's reducer refuses the checkpointed layer's gradients
("marked ready only once": its graph search does not see them) and so does xgrad's.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
#: (checkpointed layer, no_sync pass first, DDP keywords) of each case.
CASES: list[tuple[str, bool, dict[str, Any]]] = [
    ("last", False, {}),
    ("last", True, {}),
    ("last", False, {"static_graph": True}),
    ("last", False, {"gradient_as_bucket_view": True}),
    ("middle", False, {}),
    ("middle", True, {}),
    ("first", False, {}),
    ("first", True, {}),
]
#: cases where PyTorch's first step raises that error, and xgrad's too.
REFUSED = [("last", nosync, {"find_unused_parameters": True}) for nosync in (False, True)]
ONCE = "Expected to mark a variable ready only once"


def _input(g: Any) -> Any:
    """A batch that needs a gradient: a reentrant checkpoint of the first layer gives its
    parameters gradients only then."""
    import torch

    return torch.randn(4, 5, generator=g).requires_grad_()


def _steps(rank: int, which: str, layer: str, nosync: bool, kwargs: dict[str, Any]) -> list[Any]:
    """Each step's gradients (or error text) of a 3-layer model under ``which``'s DDP."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.utils.checkpoint import checkpoint

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for name, module in zip(("first", "middle", "last"), self.layers, strict=True):
                x = checkpoint(module, x, use_reentrant=True) if name == layer else module(x)
            return x

    model = Model()
    if which == "torch":
        ddp: Any = TorchDDP(model, **kwargs)
    else:
        ddp = DistributedDataParallel(model, timeout=20, **kwargs)
    g = torch.Generator().manual_seed(7 + rank)
    out: list[Any] = []
    for _ in range(3):
        model.zero_grad()
        try:
            if nosync:
                with ddp.no_sync():
                    ddp(_input(g)).pow(2).mean().backward()
            ddp(_input(g)).pow(2).mean().backward()
            out.append([None if p.grad is None else p.grad.tolist() for p in model.parameters()])
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}"[:200])
    return out


def _both(rank: int, world: int) -> list[Any]:
    """Every case under PyTorch's DDP, then under xgrad's."""
    os.environ.update(FAST)
    warnings.simplefilter("ignore")
    return [
        [_steps(rank, which, *case) for which in ("torch", "xgrad")] for case in CASES + REFUSED
    ]


def test_reentrant_checkpoint_gradients_equal_pytorchs() -> None:
    results, codes = run_ranks(_both, 2, timeout=240)
    assert all(c == 0 for c in codes.values()), (codes, results)
    for rank, (status, value) in results.items():
        assert status == "ok", value
        for case, (torch_steps, xgrad_steps) in zip(CASES + REFUSED, value, strict=True):
            if case in REFUSED:
                assert ONCE in torch_steps[0] and ONCE in xgrad_steps[0], (rank, case, value)
                continue
            assert all(isinstance(s, list) for s in torch_steps), (case, torch_steps)
            assert xgrad_steps == torch_steps, (rank, case, xgrad_steps)
