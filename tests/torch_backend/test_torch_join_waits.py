"""Under ``join()`` with even inputs, a step waits for none of ``join()``'s own collectives.

Each forward pass under ``join()`` sends an announcement (every rank's flags) and, when
a reducing backward pass may follow, a one-element round at the backward pass's first
gradient hook (:mod:`xgrad.torch_backend.join_rounds`). Waited for where they were sent
(before the module ran, and at the first hook before any bucket), each made every step
wait for the slowest rank and a collective's latency twice more than PyTorch's DDP,
which waits for neither of its own two per forward pass: +3.5% of a step on the
benchmark's transformer (docs/benchmarks.md). Now the announcement is read after the
module ran, and the round by the first wait for a bucket, once the buckets went out;
under PyTorch's own ``Join`` (whose count a rank that leaves in the round cannot read)
and with a communication hook the round is still read at the first hook, before any
bucket. The gradients are PyTorch's DDP's in every case.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 4
ANNOUNCEMENT = "join announcement"
ROUND = "join: the backward pass's round"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _events(rank: int, world: int, variant: str) -> dict[str, Any]:
    """Each step's order of what this rank did (the module's forward pass, a bucket's
    launch, a wait for one of join()'s collectives), and its gradients and PyTorch's."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    base = _net()
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(model, timeout=6.0)
    theirs = TorchDDP(reference)
    if variant == "comm_hook":
        ddp.register_comm_hook(None, allreduce_hook)
        theirs.register_comm_hook(None, allreduce_hook)
    log: list[str] = []
    model.register_forward_hook(lambda *_: log.append("module"))
    watch, comm = ddp._watch, ddp.reducer.comm
    wait_work, allreduce = watch.wait_work, comm.allreduce

    def recorded_wait(work: Any, what: str, cuda: bool = False, **kwargs: Any) -> None:
        if what in (ANNOUNCEMENT, ROUND):
            log.append(what)
        wait_work(work, what, cuda, **kwargs)

    def recorded_allreduce(buffer: torch.Tensor) -> Any:
        log.append("bucket")
        return allreduce(buffer)

    watch.wait_work = recorded_wait  # type: ignore[method-assign]
    comm.allreduce = recorded_allreduce  # type: ignore[method-assign]
    if variant == "comm_hook":
        # the hook reduces through dist.all_reduce: its launch is the hook's call
        hook = ddp.reducer.hook
        assert hook is not None

        def recorded_hook(bucket: Any) -> Any:
            log.append("bucket")
            return hook(bucket)

        ddp.reducer._hook = recorded_hook
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 5, generator=g) for _ in range(STEPS)]
    steps, grads, expected = [], [], []
    ctx = TorchJoin([ddp]) if variant == "torch_join" else ddp.join()
    with ctx:
        for x in batches:
            log.clear()
            model.zero_grad()
            ddp(x).square().sum().backward()
            steps.append(list(log))
            grads.append([p.grad.clone().numpy() for p in model.parameters()])
    with theirs.join():
        for x in batches:
            reference.zero_grad()
            theirs(x).square().sum().backward()
            expected.append([p.grad.clone().numpy() for p in reference.parameters()])
    return {"steps": steps, "grads": grads, "expected": expected}


@pytest.fixture(scope="module")
def events() -> dict[str, list[dict[str, Any]]]:
    return {
        variant: spawn(_events, 2, args=(variant,), timeout=60)
        for variant in ("join", "torch_join", "comm_hook")
    }


def _at(log: list[str], what: str) -> int:
    assert what in log, log
    return log.index(what)


@pytest.mark.parametrize("variant", ["join", "torch_join", "comm_hook"])
def test_the_announcement_is_read_after_the_module_ran(
    events: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    for rank, result in enumerate(events[variant]):
        for step, log in enumerate(result["steps"]):
            # (the first step reads it before its agreement check, the second before its
            # rebuild of the buckets: collectives of this rank's on the DDP's group)
            if step > 1:
                assert _at(log, "module") < _at(log, ANNOUNCEMENT), (rank, step, log)
            assert log.count(ANNOUNCEMENT) == 1, log


@pytest.mark.parametrize(
    ("variant", "late"), [("join", True), ("torch_join", False), ("comm_hook", False)]
)
def test_the_round_is_read_after_the_buckets_went_out_under_xgrads_join_only(
    events: dict[str, list[dict[str, Any]]], variant: str, late: bool
) -> None:
    for rank, result in enumerate(events[variant]):
        for step, log in enumerate(result["steps"]):
            assert log.count(ROUND) == 1, log
            assert (_at(log, "bucket") < _at(log, ROUND)) == late, (rank, step, log)
        for step, (ours, theirs) in enumerate(
            zip(result["grads"], result["expected"], strict=True)
        ):
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {step}")
