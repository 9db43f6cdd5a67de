"""Two DDPs in one xgrad ``Join`` with uneven inputs and gradient accumulation: the matrix.

Gloo ranks, one run per world size (2 and 3) running every scenario. Rank ``r`` has
``BATCHES[world][r]`` steps (the rank that trains longest is not always the highest, so
the rank buffers come from changes as ranks join). Step ``i`` runs, for each DDP,
``acc(i)`` ``no_sync`` passes then a synchronised one, each a forward and a backward pass
of its own micro-batch, the DDPs' passes interleaved micro-batch by micro-batch
(``sequential``: all of ``d1``'s, then all of ``d2``'s). Every step's gradients and the
final parameters and buffers are compared:

* with PyTorch's DDPs under PyTorch's ``Join`` on the same models, seeds and data, bit
  for bit, where PyTorch's can run the scenario: every DDP runs the same number of
  passes per step, interleaved (``*_aligned``);
* elsewhere with a reference computed here, in one process, with PyTorch's DDP
  semantics, within 1e-6: each step's gradient the sum over the ranks still training of
  their accumulated local gradients, over the world size; module buffers broadcast
  before a forward pass that follows a synchronised one (as ``require_forward_param_sync``
  says), from the highest rank still training; the final model the last joiner's.
  PyTorch's own ``Join`` cannot be the reference there: its joined rank shadows one pass
  of each DDP per count (the first DDP's forward pass), so where the DDPs run different
  numbers of passes in a step, or one DDP's passes all before the other's, it pairs one
  DDP's collectives with another's and gloo aborts the processes ("Received data size
  doesn't match expected size"); with ``static_graph`` and ``no_sync`` under its ``Join``
  its reducer fails an internal assert (``expect_autograd_hooks_``). With
  ``find_unused_parameters`` the reference does not model which unused parameters keep
  a zero gradient rather than none (PyTorch's joined rank re-sends its used map): a
  missing gradient counts as zero, and the optimiser (plain SGD) moves neither.

``divide_by_initial_world_size=False`` (``effective_*``): PyTorch's ``Join`` gives the
number of ranks still training to the first joinable only (its forward pass counts
them); a second DDP in the same context divides by the world size all the same, and
xgrad's does as PyTorch's (``effective_aligned``, bit for bit); the reference does too.

Before (:mod:`xgrad.torch_backend.join_absent`), every scenario where the DDPs' passes
per step differ (``every_other``, ``different``, ``sequential``) failed: the joined rank
waited in ``d2``'s announcement while the ranks still training counted at ``d1``'s next
pass, to the timeout; or, ``d2`` running twice without ``d1``, every rank raised the
join order's refusal.

The DDP timeout is short (:data:`TIMEOUT`): a hang fails the run quickly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from ranks import every_rank_ok
from torch import nn

TIMEOUT = 10.0
BATCHES = {2: (4, 2), 3: (4, 2, 3)}
STEPS = 4
LR = 0.1


class Branches(nn.Module):
    """A shared layer, then branch ``a``, ``b`` or both: a branch unused on some passes."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.s = nn.Linear(4, 4)
        self.a = nn.Linear(4, out)
        self.b = nn.Linear(4, out)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        h = torch.tanh(self.s(x))
        out = torch.zeros(())
        if "a" in branch:
            out = out + self.a(h)
        if "b" in branch:
            out = out + self.b(h)
        return out


def _linear(index: int) -> nn.Module:
    return nn.Linear(4, 4 if index == 0 else 2)


def _normed(index: int) -> nn.Module:
    width = 6 if index == 0 else 5
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 2))


def _branches(index: int) -> nn.Module:
    return Branches(3 if index == 0 else 2)


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "linear": _linear,
    "normed": _normed,
    "branches": _branches,
}


@dataclass(frozen=True)
class Scenario:
    """``acc``: the ``no_sync`` passes of each step, per DDP; ``torch``: PyTorch's ``Join``
    is the reference (else the one computed here)."""

    model: str
    acc: tuple[tuple[int, ...], tuple[int, ...]]
    torch: bool
    ddp_kw: tuple[tuple[str, Any], ...] = ()
    join_kw: tuple[tuple[str, Any], ...] = ()
    sequential: bool = False


ALIGNED = ((1, 0, 2, 1), (1, 0, 2, 1))
EVERY_OTHER = ((1, 0, 1, 0), (0, 0, 0, 0))  # d1 accumulates every other step, d2 never
DIFFERENT = ((2, 0, 1, 1), (0, 1, 2, 0))
UNUSED = (("find_unused_parameters", True),)
STATIC = (("static_graph", True),)
EFFECTIVE = (("divide_by_initial_world_size", False),)

SCENARIOS: dict[str, Scenario] = {
    "linear_aligned": Scenario("linear", ALIGNED, True),
    "linear_every_other": Scenario("linear", EVERY_OTHER, False),
    "linear_different": Scenario("linear", DIFFERENT, False),
    "linear_sequential": Scenario("linear", ALIGNED, False, sequential=True),
    "normed_aligned": Scenario("normed", ALIGNED, True),
    "normed_every_other": Scenario("normed", EVERY_OTHER, False),
    "normed_different": Scenario("normed", DIFFERENT, False),
    "unused_aligned": Scenario("branches", ALIGNED, True, UNUSED),
    "unused_every_other": Scenario("branches", EVERY_OTHER, False, UNUSED),
    "unused_different": Scenario("branches", DIFFERENT, False, UNUSED),
    "static_aligned": Scenario("linear", ALIGNED, False, STATIC),
    "static_every_other": Scenario("linear", EVERY_OTHER, False, STATIC),
    "effective_aligned": Scenario("linear", ALIGNED, True, join_kw=EFFECTIVE),
    "effective_every_other": Scenario("linear", EVERY_OTHER, False, join_kw=EFFECTIVE),
    "effective_normed": Scenario("normed", DIFFERENT, False, join_kw=EFFECTIVE),
}


def _x(rank: int, step: int, index: int, k: int) -> torch.Tensor:
    """Micro-batch ``k`` of DDP ``index`` at ``step`` on ``rank`` (``k == -1``: the
    synchronised pass's)."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + 10 * index + k + 1)
    return torch.randn(3, 4, generator=g)


def _branch(rank: int, step: int, index: int, k: int) -> str:
    """Even steps: ``a`` on every rank (``b`` unused by all); odd ones differ per rank."""
    if step % 2 == 0:
        return "a"
    return ("b", "ab", "a")[(rank + index + k) % 3]


def _passes(s: Scenario, step: int) -> list[tuple[int, int]]:
    """The step's passes in order: ``(ddp index, k)``, ``k == -1`` synchronised."""
    acc = [s.acc[0][step], s.acc[1][step]]
    if s.sequential:
        return [(d, k) for d in (0, 1) for k in [*range(acc[d]), -1]]
    out = [(d, k) for k in range(max(acc)) for d in (0, 1) if k < acc[d]]
    return [*out, (0, -1), (1, -1)]


def _forward(s: Scenario, model: Any, rank: int, step: int, index: int, k: int) -> Any:
    x = _x(rank, step, index, k)
    y = model(x, _branch(rank, step, index, k)) if s.model == "branches" else model(x)
    return y.square().mean()


def _record(modules: list[nn.Module]) -> dict[str, np.ndarray]:
    return {
        f"d{i + 1}.{n}": p.grad.clone().numpy()
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
        if p.grad is not None
    }


def _state(modules: list[nn.Module]) -> dict[str, np.ndarray]:
    return {
        f"d{i + 1}.{n}": t.detach().clone().numpy()
        for i, m in enumerate(modules)
        for n, t in m.state_dict().items()
    }


def _train(
    s: Scenario, rank: int, world: int, ddps: list[Any], modules: list[nn.Module], ctx: Any
) -> dict[str, Any]:
    """Rank ``rank``'s steps of scenario ``s`` inside the join context ``ctx``: every
    step's gradients and the final parameters and buffers."""
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    steps: list[dict[str, np.ndarray]] = []
    with ctx:
        for step in range(BATCHES[world][rank]):
            opt.zero_grad()
            for index, k in _passes(s, step):
                ddp = ddps[index]
                if k >= 0:
                    with ddp.no_sync():
                        _forward(s, ddp, rank, step, index, k).backward()
                else:
                    _forward(s, ddp, rank, step, index, k).backward()
            steps.append(_record(modules))
            opt.step()
    return {"grads": steps, "final": _state(modules)}


def _models(s: Scenario) -> list[nn.Module]:
    torch.manual_seed(0)
    return [MODELS[s.model](i) for i in (0, 1)]


def _run(rank: int, world: int, names: list[str] | None = None) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    out: dict[str, Any] = {}
    for name in names or SCENARIOS:
        s = SCENARIOS[name]
        ddp_kw, join_kw = dict(s.ddp_kw), dict(s.join_kw)
        base = _models(s)
        ours = [copy.deepcopy(m) for m in base]
        ddps = [DistributedDataParallel(m, timeout=TIMEOUT, **ddp_kw) for m in ours]
        result = {"xgrad": _train(s, rank, world, ddps, ours, Join(ddps, **join_kw))}
        if s.torch:
            theirs = [copy.deepcopy(m) for m in base]
            tddps = [TorchDDP(m, **ddp_kw) for m in theirs]
            result["torch"] = _train(s, rank, world, tddps, theirs, TorchJoin(tddps, **join_kw))
        out[name] = result
    return out


def _reference(s: Scenario, world: int) -> dict[str, Any]:
    """Every rank's steps' gradients and the final model, with PyTorch's DDP semantics
    (see the module's docstring), all ranks simulated here."""
    batches = BATCHES[world]
    params = _models(s)
    # per rank, its own copy of the modules: its buffers (the parameters stay params')
    copies = [[copy.deepcopy(m) for m in params] for _ in range(world)]
    opt = torch.optim.SGD([p for m in params for p in m.parameters()], lr=LR)
    divide_all = dict(s.join_kw).get("divide_by_initial_world_size", True)
    sync_buffers = [True, True]
    steps: list[dict[str, np.ndarray]] = []
    for step in range(max(batches)):
        training = [r for r in range(world) if step < batches[r]]
        opt.zero_grad()
        local: dict[int, list[Any]] = {r: [None, None] for r in training}
        for index, k in _passes(s, step):
            if sync_buffers[index]:
                source = copies[max(training)][index]
                for r in training:
                    for name, buf in copies[r][index].named_buffers():
                        buf.copy_(source.get_buffer(name))
            for r in training:
                m = copies[r][index]
                m.load_state_dict(params[index].state_dict() | dict(m.named_buffers()))
                m.zero_grad()
                _forward(s, m, r, step, index, k).backward()
                g = [
                    torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    for p in m.parameters()
                ]
                acc = local[r][index]
                local[r][index] = g if acc is None else [a + b for a, b in zip(acc, g, strict=True)]
            sync_buffers[index] = k < 0
            if k < 0:
                # (PyTorch's: only the first joinable divides by the ranks still training)
                div = world if divide_all or index > 0 else len(training)
                total = [sum(local[r][index][j] for r in training) / div for j in range(len(g))]
                for p, t in zip(params[index].parameters(), total, strict=True):
                    p.grad = t
        steps.append(_record(params))
        opt.step()
    last = max(r for r in range(world) if batches[r] == max(batches))
    final = [copy.deepcopy(m) for m in params]
    for index, m in enumerate(final):
        for name, buf in m.named_buffers():
            buf.copy_(copies[last][index].get_buffer(name))
    return {"grads": steps, "final": _state(final)}


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    return request.param, every_rank_ok(_run, request.param, timeout=120)


def _close(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str, exact: bool, zeros: bool
) -> None:
    """``exact``: bit for bit, the same names; else within 1e-6 (``zeros``: a name missing
    on either side is a zero gradient)."""
    names = sorted(set(got) | set(want)) if zeros else sorted(want)
    if not zeros:
        assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for name in names:
        a = got.get(name, np.zeros_like(want.get(name, got.get(name))))
        b = want.get(name, np.zeros_like(a))
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {name}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{what} {name}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradients_and_final_model_as_pytorchs_ddp(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    s = SCENARIOS[name]
    reference = None if s.torch else _reference(s, world)
    zeros = dict(s.ddp_kw).get("find_unused_parameters", False) and not s.torch
    for rank, result in results.items():
        ours = result[name]["xgrad"]
        want = result[name]["torch"] if s.torch else reference
        assert want is not None
        count = BATCHES[world][rank]
        assert len(ours["grads"]) == count, (name, rank)
        for step in range(count):
            what = f"{name} world {world} rank {rank} step {step}"
            _close(ours["grads"][step], want["grads"][step], what, s.torch, zeros)
        _close(
            ours["final"], want["final"], f"{name} world {world} rank {rank} final", s.torch, False
        )
