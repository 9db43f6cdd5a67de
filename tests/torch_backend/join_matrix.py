"""The matrix of several DDPs in one xgrad ``Join`` with uneven inputs: scenarios, runs, reference.

A scenario is data (:class:`Scenario`): a model kind, and per DDP per step the number of
``no_sync`` passes before the synchronised one, or ``None`` where that DDP runs no pass
in the step. Rank ``r`` runs ``batches[r]`` steps. Step ``i`` runs, for each DDP that
runs in it, ``acc`` ``no_sync`` passes then a synchronised one, each a forward and a
backward pass of its own micro-batch, the DDPs' passes interleaved micro-batch by
micro-batch (``sequential``: all of ``d1``'s, then all of ``d2``'s, ...). Every step's
gradients and the final parameters and buffers are compared with PyTorch's DDPs under
PyTorch's ``Join`` (``torch``: bit for bit) or with :func:`reference`, computed in one
process with PyTorch's DDP semantics (within 1e-6):

* each step's gradient of a DDP that ran: the sum over the ranks still training of their
  accumulated local gradients, over the world size (with
  ``divide_by_initial_world_size=False``, the first joinable's over the ranks still
  training: PyTorch's ``Join`` gives that count to the first joinable only); a DDP that
  ran no pass in the step has none;
* module buffers broadcast before a forward pass that follows a synchronised one of the
  same DDP (its ``require_forward_param_sync``), however many steps that DDP skipped in
  between, from the highest rank still training *at that pass* (PyTorch's
  ``_find_common_rank`` under join: the ranks still training offer their rank, the
  joined ones -1, the maximum wins); a DDP that runs no pass syncs nothing;
* the final model the last joiner's (the highest of the ranks that trained longest).

With ``find_unused_parameters`` the reference does not model which unused parameters
keep a zero gradient rather than none: a missing gradient counts as zero (``zeros``).

The test files hold their scenarios and their ``batches``; this module runs them (in
the rank processes: :func:`run_scenarios`) and checks them (:func:`check_scenario`).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from branches import Branches
from ranks import every_rank_ok
from torch import nn

LR = 0.1


# Each DDP's module has its own shapes: one DDP's collectives paired with another's
# abort in gloo rather than mix silently.
def _linear(index: int) -> nn.Module:
    return nn.Linear(4, (4, 2, 3)[index])


def _normed(index: int) -> nn.Module:
    width = (6, 5, 7)[index]
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 2))


def _branches(index: int) -> nn.Module:
    return Branches((3, 2, 4)[index])


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "linear": _linear,
    "normed": _normed,
    "branches": _branches,
}

#: per DDP, per step: its ``no_sync`` passes before the synchronised one, or ``None``
Schedule = tuple[tuple[int | None, ...], ...]


@dataclass(frozen=True)
class Scenario:
    """``acc``: the schedule; ``torch``: PyTorch's ``Join`` is the reference (else
    :func:`reference`)."""

    model: str
    acc: Schedule
    torch: bool
    ddp_kw: tuple[tuple[str, Any], ...] = ()
    join_kw: tuple[tuple[str, Any], ...] = ()
    sequential: bool = False
    slow: float = 0.0


UNUSED = (("find_unused_parameters", True),)
STATIC = (("static_graph", True),)
EFFECTIVE = (("divide_by_initial_world_size", False),)


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


def passes(s: Scenario, step: int) -> list[tuple[int, int]]:
    """The step's passes in order: ``(ddp index, k)``, ``k == -1`` synchronised."""
    acc = [a[step] for a in s.acc]
    running = [(d, n) for d, n in enumerate(acc) if n is not None]
    if s.sequential:
        return [(d, k) for d, n in running for k in [*range(n), -1]]
    most = max((n for _, n in running), default=0)
    out = [(d, k) for k in range(most) for d, n in running if k < n]
    return [*out, *((d, -1) for d, _ in running)]


def _forward(s: Scenario, model: Any, rank: int, step: int, index: int, k: int) -> Any:
    x = _x(rank, step, index, k)
    y = model(x, _branch(rank, step, index, k)) if s.model == "branches" else model(x)
    return y.square().mean()


def _record(modules: Sequence[nn.Module]) -> dict[str, np.ndarray]:
    return {
        f"d{i + 1}.{n}": p.grad.clone().numpy()
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
        if p.grad is not None
    }


def _state(modules: Sequence[nn.Module]) -> dict[str, np.ndarray]:
    return {
        f"d{i + 1}.{n}": t.detach().clone().numpy()
        for i, m in enumerate(modules)
        for n, t in m.state_dict().items()
    }


def _train(
    s: Scenario, count: int, rank: int, ddps: list[Any], modules: list[nn.Module], ctx: Any
) -> dict[str, Any]:
    """Rank ``rank``'s ``count`` steps of scenario ``s`` inside the join context ``ctx``:
    every step's gradients and the final parameters and buffers."""
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    steps: list[dict[str, np.ndarray]] = []
    with ctx:
        for step in range(count):
            opt.zero_grad()
            for index, k in passes(s, step):
                ddp = ddps[index]
                if s.slow and rank == 0:
                    time.sleep(s.slow)
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
    return [MODELS[s.model](i) for i in range(len(s.acc))]


def run_scenarios(
    scenarios: dict[str, Scenario], batches: Sequence[int], rank: int, timeout: float
) -> dict[str, Any]:
    """In a rank process: every scenario, xgrad's DDPs (``timeout``) under xgrad's
    ``Join``, and where ``torch``, PyTorch's under PyTorch's, from the same modules."""
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    out: dict[str, Any] = {}
    for name, s in scenarios.items():
        ddp_kw, join_kw = dict(s.ddp_kw), dict(s.join_kw)
        base = _models(s)
        ours = [copy.deepcopy(m) for m in base]
        ddps = [DistributedDataParallel(m, timeout=timeout, **ddp_kw) for m in ours]
        count = batches[rank]
        result = {"xgrad": _train(s, count, rank, ddps, ours, Join(ddps, **join_kw))}
        if s.torch:
            theirs = [copy.deepcopy(m) for m in base]
            tddps = [TorchDDP(m, **ddp_kw) for m in theirs]
            context = TorchJoin(tddps, **join_kw)
            result["torch"] = _train(s, count, rank, tddps, theirs, context)
        out[name] = result
    return out


def _run_world(
    scenarios: dict[str, Scenario], batches: Sequence[int], timeout: float, rank: int, world: int
) -> dict[str, Any]:
    return run_scenarios(scenarios, batches, rank, timeout)


def launch(
    scenarios: dict[str, Scenario],
    batches: dict[int, Sequence[int]],
    world: int,
    timeout: float,
    limit: float,
) -> tuple[int, dict[int, Any]]:
    """Every scenario at ``world`` ranks in one launch (a test module's fixture; ``limit``:
    the launcher's, past the DDPs' ``timeout``): the world size and each rank's results."""
    run = functools.partial(_run_world, scenarios, batches[world], timeout)
    return world, every_rank_ok(run, world, timeout=limit)


def reference(s: Scenario, batches: Sequence[int]) -> dict[str, Any]:
    """Every rank's steps' gradients and the final model, with PyTorch's DDP semantics
    (see the module's docstring), all ranks simulated here."""
    world, n = len(batches), len(s.acc)
    params = _models(s)
    # per rank, its own copy of the modules: its buffers (the parameters stay params')
    copies = [[copy.deepcopy(m) for m in params] for _ in range(world)]
    opt = torch.optim.SGD([p for m in params for p in m.parameters()], lr=LR)
    divide_all = dict(s.join_kw).get("divide_by_initial_world_size", True)
    sync_buffers = [True] * n
    steps: list[dict[str, np.ndarray]] = []
    for step in range(max(batches)):
        training = [r for r in range(world) if step < batches[r]]
        opt.zero_grad()
        local: dict[int, list[Any]] = {r: [None] * n for r in training}
        for index, k in passes(s, step):
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
                div = world if divide_all or index > 0 else len(training)
                size = len(local[training[0]][index])
                total = [sum(local[r][index][j] for r in training) / div for j in range(size)]
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


def _close(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str, exact: bool, zeros: bool
) -> None:
    """``exact``: bit for bit, the same names; else within 1e-5 (``zeros``: a name missing
    on either side is a zero gradient). Not 1e-6: a gradient that cancels to zero (a
    bias before a BatchNorm, float32) is rounding noise, 1.5e-6 against 8e-8 on one
    machine for the same code that agreed within 1e-6 on another."""
    names = sorted(set(got) | set(want)) if zeros else sorted(want)
    if not zeros:
        assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for name in names:
        a = got.get(name, np.zeros_like(want.get(name, got.get(name))))
        b = want.get(name, np.zeros_like(a))
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {name}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{what} {name}")


def check_scenario(s: Scenario, name: str, batches: Sequence[int], results: dict[int, Any]) -> None:
    """Scenario ``name``'s gradients at every step and final model, on every rank, as its
    reference's."""
    world = len(batches)
    ref = None if s.torch else reference(s, batches)
    zeros = dict(s.ddp_kw).get("find_unused_parameters", False) and not s.torch
    for rank, result in results.items():
        ours = result[name]["xgrad"]
        want = result[name]["torch"] if s.torch else ref
        assert want is not None
        count = batches[rank]
        assert len(ours["grads"]) == count, (name, rank)
        for step in range(count):
            what = f"{name} world {world} rank {rank} step {step}"
            _close(ours["grads"][step], want["grads"][step], what, s.torch, zeros)
        what = f"{name} world {world} rank {rank} final"
        _close(ours["final"], want["final"], what, s.torch, False)
