"""Two DDPs in one xgrad ``Join``, an iteration given up in a ``no_sync`` pass of either.

``Join([d1, d2])`` over gloo ranks with uneven inputs, a ``try`` per iteration: each
iteration runs ``k`` ``no_sync`` passes, each through ``d1`` then ``d2`` (forward and
backward), then a synchronised pass through each. At one iteration one rank's forward
pass (``ValueError("boom")``) or backward pass (a hook on a weight's gradient,
``ValueError("grad boom")``) raises in an accumulation pass of ``d1`` or ``d2``. Every rank
that ran the iteration must raise it there, once, naming the failing rank, within half
the timeout; ranks that had joined raise it as they leave ``join()``; the other
iterations train with ``join()``'s gradients, and a join context after them trains as
PyTorch's ``Join`` over PyTorch's DDPs.

Before (:mod:`xgrad.torch_backend.join_given_up`), every rank waited past the timeout
(the launcher's limit ends it here): the failing rank skipped ``d2``'s pass of the
micro-batch, whose announcement the others waited for; a failure in ``d2`` gave up
``d2``'s step only, so ``d1``'s next pass of the others met the failing rank's next
iteration's (at three ranks, "the ranks still training ran different forward passes"
where the passes differed); a ``no_sync`` backward pass that raised was told at that
DDP's next forward pass only, after ``d1``'s, or, at the failing rank's last input, never
(``one_ddp``: with a single DDP too).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
from join_cases import (
    check_after_as_pytorch,
    check_grads,
    check_raised_once,
    grads,
    run_steps,
    trained_after,
)
from ranks import every_rank_ok

TIMEOUT = 3.0

#: name -> world -> (batches of rank 0, 1, ...; the failing rank; the iteration it fails
#: at; the no_sync passes of each iteration; the failing pass; the DDP that fails (0, 1);
#: what raises)
Case = tuple[list[int], int, int, tuple[int, ...], int, int, str]
CASES: dict[str, dict[int, Case]] = {
    "d1_forward": {
        2: ([1, 3], 1, 1, (1, 1, 1), 0, 0, "forward"),
        3: ([1, 3, 3], 2, 1, (1, 1, 1), 0, 0, "forward"),
    },
    # the last accumulation pass: d1's next pass of the others is the synchronised one
    "d2_forward": {
        2: ([1, 3], 1, 1, (2, 2, 2), 1, 1, "forward"),
        3: ([1, 3, 3], 2, 1, (2, 2, 2), 1, 1, "forward"),
    },
    # the failing rank's last input; the others accumulate more in that iteration
    "d1_backward_last_input": {
        2: ([2, 3], 0, 1, (1, 2, 1, 2), 0, 0, "backward"),
        3: ([2, 3, 4], 0, 1, (1, 2, 1, 2), 0, 0, "backward"),
    },
    # the failing rank's next iteration accumulates nothing
    "d2_backward_next_unaccumulated": {
        2: ([3, 4], 1, 2, (0, 1, 2, 0), 0, 1, "backward"),
        3: ([1, 3, 4], 2, 2, (0, 1, 2, 0), 0, 1, "backward"),
    },
    # the same shape as d1_backward_last_input, one DDP in the context
    "one_ddp": {
        2: ([2, 3], 0, 1, (1, 2, 1, 2), 0, 0, "backward"),
        3: ([2, 3, 4], 0, 1, (1, 2, 1, 2), 0, 0, "backward"),
    },
}
BOOM = {"forward": "forward: ValueError: boom", "backward": "backward: ValueError: grad boom"}


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    torch.manual_seed(0)
    base = [nn.Linear(5, 5), nn.Linear(5, 2)]
    ours = [copy.deepcopy(m) for m in base]
    armed: dict[tuple[int, str], bool] = {}

    def pre_hook(index: int, module: Any, inputs: Any) -> None:
        if armed.pop((index, "forward"), False):
            raise ValueError("boom")

    def grad_hook(index: int, grad: torch.Tensor) -> torch.Tensor:
        if armed.pop((index, "backward"), False):
            raise ValueError("grad boom")
        return grad

    for index, m in enumerate(ours):
        m.register_forward_pre_hook(functools.partial(pre_hook, index))
        m.weight.register_hook(functools.partial(grad_hook, index))
    ddps = [DistributedDataParallel(m, timeout=TIMEOUT) for m in ours]
    x = torch.arange(20.0).reshape(4, 5) * (rank + 1) / 10
    for m in base:  # this rank's own gradient of a pass: the parameters never move
        m(x).square().mean().backward()
    out: dict[str, Any] = {"local": grads(base)}

    def step(used: list[Any], case: Case, i: int) -> list[Any]:
        _, failing, at, acc, k_at, ddp_at, kind = case
        for m in ours:
            m.zero_grad()
        for k in range(acc[i]):
            if rank == failing and i == at and k == k_at:
                armed[(ddp_at, kind)] = True
            for ddp in used:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
        for ddp in used:
            ddp(x).square().mean().backward()
        return grads(ours[: len(used)])

    for name, per_world in CASES.items():
        used = ddps[:1] if name == "one_ddp" else ddps
        case = per_world[world]
        out[name] = run_steps(
            functools.partial(Join, used), case[0][rank], functools.partial(step, used, case)
        )
    # A join context after them, against PyTorch's Join over its DDPs, same parameters.
    theirs = [copy.deepcopy(m) for m in ours]
    torch_ddps = [TorchDDP(m) for m in theirs]
    sides = [
        ("xgrad", ddps, ours, functools.partial(Join, ddps)),
        ("torch", torch_ddps, theirs, functools.partial(TorchJoin, torch_ddps)),
    ]
    out["after"] = trained_after(sides, x, rank, lambda i: i % 2, lambda y: y.square().mean())
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    # a hang is a failure of the launcher (its limit), not a stuck suite
    return request.param, every_rank_ok(_run, request.param, timeout=45)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_iteration_once_at_once_naming_the_rank(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing, at, acc, _, _, kind = CASES[name][world]
    boom = f"rank {failing} in {BOOM[kind]}"
    for rank, result in results.items():
        named = not (rank == failing and kind == "backward")  # (autograd's own there)
        label = (name, rank)
        check_raised_once(
            result[name], batches[rank], at, boom, label, limit=TIMEOUT / 2, named=named
        )
    # the other iterations: every pass reduced
    check_grads(results, world, name, batches, passes=lambda i: acc[i] + 1)


def test_a_join_context_after_them_trains_as_pytorchs(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    check_after_as_pytorch(outcome[1], rtol=1e-5)
