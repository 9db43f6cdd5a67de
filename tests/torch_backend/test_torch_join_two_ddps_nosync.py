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
import time
from typing import Any

import numpy as np
import pytest
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


def _grads(models: list[Any]) -> list[Any]:
    return [p.grad.clone().numpy() for m in models for p in m.parameters()]


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.failure_errors import RankError
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
    out: dict[str, Any] = {"local": _grads(base)}
    for name, per_world in CASES.items():
        batches, failing, at, acc, k_at, ddp_at, kind = per_world[world]
        used = ddps[:1] if name == "one_ddp" else ddps
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with Join(used):
                for i in range(batches[rank]):
                    for m in ours:
                        m.zero_grad()
                    try:
                        for k in range(acc[i]):
                            if rank == failing and i == at and k == k_at:
                                armed[(ddp_at, kind)] = True
                            for ddp in used:
                                with ddp.no_sync():
                                    ddp(x).square().mean().backward()
                        for ddp in used:
                            ddp(x).square().mean().backward()
                        steps.append(_grads(ours[: len(used)]))
                    except (RankError, ValueError) as exc:
                        steps.append(f"{type(exc).__name__}: {exc}")
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}
    # A join context after them, against PyTorch's Join over its DDPs, same parameters.
    theirs = [copy.deepcopy(m) for m in ours]
    torch_ddps = [TorchDDP(m) for m in theirs]
    after: dict[str, list[Any]] = {"xgrad": [], "torch": []}
    for side, ds, ms, context in (
        ("xgrad", ddps, ours, Join(ddps)),
        ("torch", torch_ddps, theirs, TorchJoin(torch_ddps)),
    ):
        with context:
            for i in range(1 + rank):
                for m in ms:
                    m.zero_grad()
                for _ in range(i % 2):
                    for d in ds:
                        with d.no_sync():
                            d(x * (i + 1)).square().mean().backward()
                for d in ds:
                    d(x * (i + 1)).square().mean().backward()
                after[side].append(_grads(ms))
    out["after"] = after
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
        run = result[name]
        steps = run["steps"]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never a timeout
        assert len(steps) == batches[rank], (name, rank, run)
        errors = [i for i, s in enumerate(steps) if isinstance(s, str)]
        if at < batches[rank]:  # ran the iteration: raised there, once; left cleanly
            assert errors == [at], (name, rank, run)
            if not (rank == failing and kind == "backward"):  # (autograd's own there)
                assert boom in steps[at], (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join()
            assert errors == [], (name, rank, run)
            assert run["left"].startswith("RankError") and boom in run["left"], (name, rank, run)
        for i, grads in enumerate(steps):  # the other iterations: every pass reduced
            if isinstance(grads, str):
                continue
            training = [r for r in results if i < batches[r]]
            for j, got in enumerate(grads):
                want = (acc[i] + 1) * sum(results[r]["local"][j] for r in training) / world
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} rank {rank} step {i}"
                )


def test_a_join_context_after_them_trains_as_pytorchs(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    _, results = outcome
    for rank, result in results.items():
        ours, theirs = result["after"]["xgrad"], result["after"]["torch"]
        assert len(ours) == len(theirs) == rank + 1
        for a, b in zip(ours, theirs, strict=True):
            for p, q in zip(a, b, strict=True):
                np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
