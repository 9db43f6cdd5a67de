"""A tensor computed before the step in another thread than the step's, that every
microbatch reads (``pipeline_shared_graph``).

Autograd numbers each node from its own thread's counter, and the runtime took a node
numbered below the counter at the forward's start as made before it. A node made in
another thread has that thread's number: ``w2 = w.tanh()`` made in a thread that had made
more nodes than the step's (or on the main thread, the steps run in a worker thread,
whose counter starts at 0) was numbered above, not seen, and the second microbatch's
backward raised "Trying to backward through the graph a second time" with a message that
said the stage had read it late. Now a node numbered outside the numbers the forward's
own nodes took is older, whatever its thread: the gradients are the unpipelined model's,
to 1e-12 in float64, whether the stage's graph is walked once a step (m = 4) or every
forward (m = 3).

One spawn of two gloo ranks: a two-rank pipeline whose two stages read ``w2``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: (schedule, m): the stage's graph walked at its first forward alone, or every forward
CASES = [("gpipe", 4), ("1f1b", 4), ("1f1b", 3)]
#: where w2 is made and where the steps run
WHERE = ("w2 in a busier thread", "steps in a fresh thread")


class Stage(nn.Module):
    """A tanh layer times ``read[0]`` (a plain list: not registered)."""

    def __init__(self, lin: nn.Linear, read: list[torch.Tensor]) -> None:
        super().__init__()
        self.lin = lin
        self.read = read

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * self.read[0]


def _busy(nodes: int) -> None:
    """Make ``nodes`` autograd nodes in this thread (its counter goes up by as many)."""
    a = torch.ones(2, requires_grad=True)
    for _ in range(nodes):
        a = a * 1.0


def _in_thread(fn: Callable[[], Any]) -> Any:
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(fn()))
    thread.start()
    thread.join()
    return found[0]


def _model(m: int) -> tuple[list[Stage], nn.Parameter, list[Any], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4).double() for _ in range(2)]
    w = nn.Parameter(torch.tensor([0.5, 1.5, -1.0, 2.0], dtype=torch.float64))
    read: list[Any] = [None]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    t = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    return [Stage(lin, read) for lin in lins], w, read, x, t


def _grads(stages: list[Stage], w: torch.Tensor) -> dict[str, torch.Tensor]:
    named = {f"lin{s}.{k}": p for s, st in enumerate(stages) for k, p in st.named_parameters()}
    named["w"] = w
    return {k: torch.zeros_like(v) if v.grad is None else v.grad.clone() for k, v in named.items()}


def _reference(m: int) -> dict[str, torch.Tensor]:
    stages, w, read, x, t = _model(m)
    read[0] = w.tanh()
    total = torch.zeros((), dtype=torch.float64)
    for xk, tk in zip(x.tensor_split(m), t.tensor_split(m), strict=True):
        total = total + nn.functional.mse_loss(stages[1](stages[0](xk)), tk) / m
    total.backward()
    return _grads(stages, w)


def _pipelined(rank: int, name: str, m: int, where: str) -> Any:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    stages, w, read, x, t = _model(m)
    rt = PipelineRuntime(xp.make(name, 2, m), [stages[rank]], nn.functional.mse_loss, timeout=20)

    def step() -> Any:
        try:
            rt.step(x if rank == 0 else None, t if rank == 1 else None)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return _grads(stages, w)

    if where == "w2 in a busier thread":
        ahead = int(_get_sequence_nr()) + 1000  # (this thread's counter, and more)

        def made() -> torch.Tensor:
            _busy(ahead)
            return w.tanh()

        read[0] = _in_thread(made)
        return step()
    _busy(1000)  # (the main thread of a program has made many)
    read[0] = w.tanh()
    return _in_thread(step)


def _run(rank: int, world: int) -> dict[str, Any]:
    return {f"{c} {where}": _pipelined(rank, *c, where) for c in CASES for where in WHERE}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_run, 2, timeout=120)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_graph_made_in_another_thread_gets_the_unpipelined_gradient(
    results: list[dict[str, Any]], case: tuple[str, int], where: str
) -> None:
    parts = [results[rank][f"{case} {where}"] for rank in (0, 1)]
    assert not any(isinstance(p, str) for p in parts), parts
    got = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    want = _reference(case[1])
    bad = {
        k: (got[k] - want[k]).abs().max().item()
        for k in want
        if not torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-12)
    }
    assert not bad, bad
