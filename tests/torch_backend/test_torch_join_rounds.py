"""Forward passes without a backward pass under ``join()``: evaluations, validation losses.

Rank ``r`` has ``1 + 2 r`` batches, so ranks join one after another, the first after a
single step (its buckets never rebuilt). In every variant here, once a rank has joined,
PyTorch 2.13's DDP aborts the processes in gloo ("Received data size doesn't match
expected size"): it tells its joined ranks that a backward pass follows every forward
pass, ``torch.no_grad()`` ones included. xgrad's ran ``torch.no_grad()`` evaluations
except the first after a rank joined before the rebuild (waited out its timeout), and a
forward pass with gradients on and no backward pass after it (a validation loss)
waited out its timeout or aborted in gloo the same way.

Now the variants where every rank still training runs the same passes train, with the
gradients and final model of PyTorch's DDP running the same loop without the extra
forward passes (with the ``no_sync`` pass that a validation pass leaves reduced, as
PyTorch's reducer does, run synchronised). Where the ranks
still training run different passes, every rank raises at once (well within the DDP's
timeout), naming what it or each rank did.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
import torch
from ranks import run_ranks
from torch import nn

from xgrad.torch_backend.spawn import spawn

#: the DDP's timeout here: a failing variant must raise in well under it.
TIMEOUT = 6.0


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 2))


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 5, generator=g) for _ in range(1 + 2 * rank)]


def _loop(ddp: nn.Module, module: nn.Module, ctx: Any, rank: int, extra: str) -> dict[str, Any]:
    """Train on this rank's batches inside ``ctx``; ``extra``: the passes each step adds
    (evaluation passes run in eval mode, so the buffers are PyTorch's reference's)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    val = torch.ones(4, 5)
    grads = []

    def evaluate(grad: bool) -> None:
        module.eval()
        with torch.set_grad_enabled(grad):
            ddp(val)
        module.train()

    with ctx:
        for x in _batches(rank):
            opt.zero_grad()
            if extra in ("nograd_before", "grad_before"):
                evaluate(extra == "grad_before")
            if extra == "grad_nosync":
                evaluate(True)
                with ddp.no_sync():  # type: ignore[operator]
                    ddp(x).square().sum().backward()
            if extra == "twice":
                ddp(x).square().sum().backward()
            ddp(x).square().sum().backward()
            grads.append({n: p.grad.clone().numpy() for n, p in module.named_parameters()})
            opt.step()
            if extra in ("nograd_after", "grad_after"):
                evaluate(extra == "grad_after")
    return {
        "grads": grads,
        "final": {n: t.detach().clone().numpy() for n, t in module.state_dict().items()},
    }


#: variant: (the passes xgrad's loop adds, PyTorch's reference loop's, join() arguments,
#: PyTorch's Join over xgrad's DDP).
WORKING = {
    "nograd_before": ("nograd_before", "", {}, False),
    "nograd_after": ("nograd_after", "", {}, False),
    "grad_before": ("grad_before", "", {}, False),
    # The last pass of every rank is a validation forward pass: it leaves join() with the
    # round of that pass open (the last to leave closes the joined ranks' count).
    "grad_after": ("grad_after", "", {}, False),
    "grad_after_torch_join": ("grad_after", "", {}, True),
    "grad_before_effective_world": (
        "grad_before",
        "",
        {"divide_by_initial_world_size": False},
        False,
    ),
    # The reducer, prepared by the validation pass, reduces the no_sync pass after it, as
    # PyTorch's does: PyTorch's reference runs that pass synchronised.
    "grad_nosync": ("grad_nosync", "twice", {}, False),
}


def _working(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, Any] = {}
    for name, (extra, reference, join_kw, torch_join) in WORKING.items():
        base = _net()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        ours = DistributedDataParallel(m1, timeout=TIMEOUT)
        theirs = TorchDDP(m2)
        ctx = TorchJoin([ours]) if torch_join else ours.join(**join_kw)
        started = time.monotonic()
        out[name] = {
            "xgrad": _loop(ours, m1, ctx, rank, extra),
            "seconds": time.monotonic() - started,
            "torch": _loop(theirs, m2, theirs.join(**join_kw), rank, reference),
        }
    # throw_on_early_termination, every rank's last pass a validation pass (the first to
    # leave enters that pass's round with its count): PyTorch's errors, as its DDP raises
    # them in the same loop.
    thrown = out["throw"] = {}
    for impl, torch_join in (("xgrad", False), ("xgrad_torch_join", True), ("torch", False)):
        m = _net()
        ddp = TorchDDP(m) if impl == "torch" else DistributedDataParallel(m, timeout=TIMEOUT)
        if torch_join:
            ctx = TorchJoin([ddp], throw_on_early_termination=True)
        else:
            ctx = ddp.join(throw_on_early_termination=True)
        try:
            _loop(ddp, m, ctx, rank, "grad_after")
            thrown[impl] = "no error"
        except RuntimeError as err:
            thrown[impl] = str(err)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def working(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, spawn(_working, request.param, timeout=120)


@pytest.mark.parametrize("variant", list(WORKING))
def test_forward_passes_without_backward_under_join_train_as_pytorchs_loop_without_them(
    working: tuple[int, list[dict[str, Any]]], variant: str
) -> None:
    size, results = working
    for rank, result in enumerate(results):
        ours, theirs = result[variant]["xgrad"], result[variant]["torch"]
        assert result[variant]["seconds"] < TIMEOUT, (rank, result[variant]["seconds"])
        assert len(ours["grads"]) == 1 + 2 * rank
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
            for n in b:
                np.testing.assert_allclose(
                    a[n], b[n], rtol=1e-6, atol=1e-6, err_msg=f"{size} {rank} {step} {n}"
                )
        for n in theirs["final"]:
            np.testing.assert_allclose(
                ours["final"][n], theirs["final"][n], rtol=1e-6, atol=1e-6, err_msg=n
            )


def test_throw_on_early_termination_raises_pytorchs_errors_after_a_validation_pass(
    working: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = working
    assert results[0]["throw"]["torch"] == "Rank 0 exhausted all inputs."
    for result in results:
        thrown = result["throw"]
        assert thrown["xgrad"] == thrown["xgrad_torch_join"] == thrown["torch"], thrown


def _failing(rank: int, world: int, variant: str, torch_join: bool) -> tuple[str, float]:
    """One variant where the ranks still training run different passes: what this rank
    raised, and how long after the join context began."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join as TorchJoin

    from xgrad.torch_backend import DistributedDataParallel

    model = _net()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    val = torch.ones(4, 5)
    ddp(val).sum().backward()  # the first step's setup (agreement, rebuild) done outside
    dist.barrier()
    batches = _batches(rank)
    started = time.monotonic()
    try:
        with TorchJoin([ddp]) if torch_join else ddp.join():
            for i, x in enumerate(batches):
                if variant == "nograd_one_rank" and rank == world - 1:
                    with torch.no_grad():  # evaluates where the others train
                        ddp(val)
                if variant == "grad_one_rank" and rank == 1 and i == 0:
                    ddp(val)  # a forward pass with gradients on that the others did not run
                if variant == "leaves_first" and rank == world - 1:
                    ddp(val)  # then leaves, no rank joined yet, while the others go back
                    break
                ddp(x).sum().backward()
                if variant == "leaves_after_grad" and rank == 1 and i == len(batches) - 1:
                    ddp(val)  # then leaves while rank 2 goes on to its backward pass
        return "no error", time.monotonic() - started
    except RuntimeError as err:
        return str(err), time.monotonic() - started


@pytest.mark.parametrize(
    ("variant", "world", "torch_join"),
    [
        ("nograd_one_rank", 2, False),
        ("nograd_one_rank", 3, False),
        ("grad_one_rank", 2, False),
        ("grad_one_rank", 3, True),
        ("leaves_after_grad", 3, False),
        ("leaves_after_grad", 3, True),
        # No rank has joined: under xgrad's join() the ranks that go back launch their
        # buckets before they read the round; the rank that leaves reads it in its count.
        ("leaves_first", 2, False),
        ("leaves_first", 3, True),
    ],
)
def test_ranks_still_training_that_run_different_passes_raise_at_once_naming_them(
    variant: str, world: int, torch_join: bool
) -> None:
    results, codes = run_ranks(_failing, world, (variant, torch_join), timeout=60)
    assert all(code == 0 for code in codes.values()), (codes, results)
    messages = {}
    for rank, (status, value) in sorted(results.items()):
        assert status == "ok", value
        message, seconds = value
        assert seconds < TIMEOUT / 2, (rank, seconds, message)
        messages[rank] = message
    if variant == "nograd_one_rank":
        others = "rank 0" if world == 2 else "ranks 0, 1"
        expected = (
            f"join(): the ranks still training ran different forward passes: rank "
            f"{world - 1} under torch.no_grad(); {others} with gradients on (inside join()"
        )
        assert all(m.startswith(expected) for m in messages.values()), messages
    elif variant == "grad_one_rank":
        # The rank that ran the extra pass names itself; the others raise what the first
        # rank to see it posted (a rank that went on to its backward pass).
        assert messages[1].startswith(
            "rank 1 ran a forward pass with gradients on and no backward pass after it"
        ), messages
        for rank in set(messages) - {1}:
            assert "began the backward pass of a step that 1 of the" in messages[rank]
            assert "ranks still training left without one" in messages[rank]
    elif variant == "leaves_first":
        # The last rank leaves after its validation pass; the others go back.
        last = world - 1
        for message in messages.values():
            assert "left without one" in message or "left join() after" in message, messages
        assert messages[0].startswith("rank 0 began") or "rank 0 in join" in messages[0]
        left = f"rank {last} left join() after a forward pass with gradients on"
        assert messages[last].startswith(left) != torch_join, messages
    else:
        # Rank 0 has joined; rank 1 leaves after its validation pass, rank 2 goes back.
        for message in messages.values():
            assert "left without one" in message or "left join() after" in message, messages
        assert any(m.startswith("rank 2 began") or "rank 2 in join" in m for m in messages.values())
        assert sum("rank 1 left join()" in m for m in messages.values()) == (0 if torch_join else 1)
