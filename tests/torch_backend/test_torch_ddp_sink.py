"""Outputs a loss leaves out under ``find_unused_parameters``, against PyTorch's DDP.

A model returning a namedtuple or dict of a main output and auxiliary heads, trained with
a loss that uses the auxiliary head only on some steps (and, in one case, only on some
ranks): PyTorch's DDP routes the outputs through its ``_DDPSink``, so the head's
parameters count as unused where the loss left them out. xgrad's DDP must give the same
gradients (``None`` where no rank used the head) and parameters, bit for bit, with
reentrant and non-reentrant checkpointing too. A dataclass output is not routed by either
(PyTorch flattens outputs with its pytree): xgrad raises at the end of that backward pass,
saying why.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from xgrad.torch_backend.spawn import spawn

WORLD = 2
Out = collections.namedtuple("Out", "main aux extra")


@dataclasses.dataclass
class DataOut:
    main: torch.Tensor
    aux: torch.Tensor


class Heads(nn.Module):
    """A trunk, a main head and an auxiliary head (``e``), returned in ``kind``'s container."""

    def __init__(self, kind: str, reentrant: bool | None) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.c = nn.Linear(12, 3)
        self.e = nn.Linear(12, 2)
        self.kind, self.reentrant = kind, reentrant

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))

    def forward(self, x: torch.Tensor) -> Any:
        if self.reentrant is None:
            h = self.trunk(x)
        else:
            h = checkpoint(self.trunk, x, use_reentrant=self.reentrant)
        main, aux = self.c(h), self.e(h)
        if self.kind == "dict":
            return {"main": main, "aux": aux, "extra": main * 2}
        if self.kind == "dataclass":
            return DataOut(main, aux)
        return Out(main, aux, main * 2)


def _part(out: Any, name: str) -> torch.Tensor:
    return out[name] if isinstance(out, dict) else getattr(out, name)


def _train(rank: int, wrap: Any, kind: str, reentrant: bool | None, per_rank: bool) -> list[Any]:
    torch.manual_seed(0)
    model = Heads(kind, reentrant)
    ddp = wrap(model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        out = ddp(x)
        loss = ((_part(out, "main") - y) ** 2).sum()
        if (step + (rank if per_rank else 0)) % 2 == 0:
            loss = loss + _part(out, "aux").sum()
        loss.backward()
        seen.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen.append([p.detach().clone() for p in model.parameters()])
    return seen


CASES = {
    "namedtuple": ("namedtuple", None, False),
    "dict": ("dict", None, False),
    "namedtuple_per_rank": ("namedtuple", None, True),
    "dict_reentrant": ("dict", True, False),
    "namedtuple_nonreentrant_per_rank": ("namedtuple", False, True),
}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    import warnings

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    warnings.simplefilter("ignore")  # checkpoint's and PyTorch's find_unused warnings
    out: dict[str, Any] = {}
    for name, args in CASES.items():
        out[name] = (_train(rank, DistributedDataParallel, *args), _train(rank, TorchDDP, *args))
    try:
        _train(rank, DistributedDataParallel, "dataclass", None, False)
    except RuntimeError as exc:
        out["dataclass"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_the_loss_leaves_out_match_pytorch(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank, by_name in enumerate(results):
        ours, theirs = by_name[name]
        for step, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
            for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
                where = f"{name}, rank {rank}, step {step}, tensor {i}"
                assert (a is None) == (b is None), where
                if a is not None:
                    assert torch.equal(a, b), where
    # The auxiliary head really went unused on every rank in the odd steps.
    assert results[0]["namedtuple"][0][1][-1] is None


def test_a_dataclass_output_is_not_routed_and_the_error_says_so(
    results: list[dict[str, Any]],
) -> None:
    for rank, by_name in enumerate(results):
        message = by_name["dataclass"]  # PyTorch's, at the next forward pass
        assert "Since `find_unused_parameters=True` is enabled" in message, message
        assert "wasn't able to locate the output tensors" in message, message
        assert f"Parameter indices which did not receive grad for rank {rank}: " in message
