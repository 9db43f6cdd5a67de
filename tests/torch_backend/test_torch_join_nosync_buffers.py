"""Under ``join()``, a step that fails while a rank has joined, in a model with buffers.

Gloo ranks, each scenario a join context of its own, in one run: a ``Linear`` then a
``BatchNorm1d`` (running statistics, broadcast by DDP at each step's first pass), each
step a ``no_sync`` pass then a synchronised one. Rank 0 has one step and joins; the
others have three, and the last rank fails at step 1, caught per step:

* ``acc_forward``: its ``no_sync`` forward pass raises (in a pre-hook of the model);
* ``acc_backward``: its ``no_sync`` backward pass raises (a hook on a weight's gradient);
* ``sync_forward``: its synchronised forward pass raises;
* ``sync_backward``: its synchronised backward pass raises;
* ``sync_hook``: its communication hook raises in the synchronised backward pass.

The ranks still training sync the buffers at the first pass after a failed step,
whatever the last pass left (:func:`~xgrad.torch_backend.ddp_buffers.first_pass_regrouped`);
the joined rank's shadow did not follow (it synced only where the last pass it heard
said so): the broadcast met its next collective, and every rank raised a timeout (3 s)
instead of the failure, in every scenario, and in the context after them. Now its shadow of that
first pass syncs too: every rank raises the failure once (the joined one as it leaves
``join()``), the steps after it train with ``join()``'s gradients, the ranks still
training enter each step's first pass with the same running statistics, and every rank
leaves ``join()`` with the same buffers.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import pytest
from join_cases import (
    check_grads,
    check_raised_once,
    check_trained,
    grads,
    run_steps,
    two_passes,
)
from ranks import armed_hook, every_rank_ok

TIMEOUT = 3.0
AT = 1
WHERE = {
    "acc_forward": "forward: ValueError: boom",
    "acc_backward": "backward: ValueError: grad boom",
    "sync_forward": "forward: ValueError: boom",
    "sync_backward": "backward: ValueError: grad boom",
    "sync_hook": "comm hook, bucket 0: ValueError: hook boom",
}


def _batches(world: int) -> list[int]:
    return [1] + [3] * (world - 1)


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    trip = {"forward": False, "backward": False}
    seen: dict[int, list[list[float]]] = {}  # per step, the running mean BatchNorm began with
    current = [0]

    def pre_hook(module: Any, inputs: Any) -> None:
        if trip["forward"]:
            trip["forward"] = False
            raise ValueError("boom")

    def grad_hook(grad: torch.Tensor) -> torch.Tensor:
        if trip["backward"]:
            trip["backward"] = False
            raise ValueError("grad boom")
        return grad

    model.register_forward_pre_hook(pre_hook)
    model[0].weight.register_hook(grad_hook)
    model[1].register_forward_pre_hook(
        lambda m, i: seen.setdefault(current[0], []).append(m.running_mean.tolist())
    )
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    comm_hook, hook_armed = armed_hook()
    ddp.register_comm_hook(None, comm_hook)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1) + torch.tensor([0.0, 1.0, 3.0, 2.0])
    model(x).pow(2).mean().backward()  # this rank's own gradient (train mode: the batch's)
    out: dict[str, Any] = {"local": grads([model])}

    def step(name: str, i: int) -> list[Any]:
        model.zero_grad()
        current[0] = i
        failing = rank == world - 1 and i == AT
        for pass_ in ("acc", "sync"):
            trip["forward"] = failing and name == f"{pass_}_forward"
            trip["backward"] = failing and name == f"{pass_}_backward"
            hook_armed[0] = failing and name == f"{pass_}_hook"
            with ddp.no_sync() if pass_ == "acc" else contextlib.nullcontext():
                ddp(x).pow(2).mean().backward()
        return grads([model])

    for name in [*WHERE, "after"]:
        seen.clear()
        out[name] = run_steps(ddp.join, _batches(world)[rank], functools.partial(step, name))
        out[name]["seen"] = dict(seen)
        out[name]["buffers"] = [b.tolist() for b in model[1].buffers()]
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=90)


@pytest.mark.parametrize("name", list(WHERE))
def test_every_rank_raises_the_step_once_and_the_steps_after_it_train(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing = _batches(world), world - 1
    for rank, result in results.items():
        boom = f"rank {failing} in {WHERE[name]}"
        # (the failing rank's backward raises autograd's own error there)
        named = not (rank == failing and name.endswith("_backward"))
        label = (name, rank)
        check_raised_once(
            result[name], batches[rank], AT, boom, label, limit=TIMEOUT / 2, named=named
        )
    check_grads(results, world, name, batches, passes=two_passes)


@pytest.mark.parametrize("name", [*WHERE, "after"])
def test_the_buffers_are_synced_after_the_failed_step(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    """Each step's first pass begins with the buffers of one rank on every rank still
    training (the step after the failed one too), and every rank leaves with the same."""
    _, results = outcome
    training = [r for r in results if r > 0]
    for i in [i for i in range(3) if i != AT or name == "after"]:
        values = [results[r][name]["seen"][i][0] for r in training]
        for r, v in zip(training, values, strict=True):
            np.testing.assert_allclose(v, values[0], err_msg=f"{name} step {i} rank {r}")
    ended = [results[r][name]["buffers"] for r in results]
    for r, b in zip(results, ended, strict=True):
        for got, want in zip(b, ended[0], strict=True):
            np.testing.assert_allclose(got, want, err_msg=f"{name}: rank {r}'s buffers")


def test_a_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    check_trained(results, world, "after", _batches(world), passes=two_passes)
