"""A backward pass that raises before any of DDP's gradient hooks ran, in gradient accumulation or under ``join()``.

Three gloo ranks; each step accumulates one ``no_sync`` micro-batch, then runs a
synchronised one (a ``try`` around the step, as a loop that skips a bad batch has). At
step 2, rank 1's backward pass of one of them raises from a hook on the model's output,
before any gradient of the model, so before any of DDP's hooks: the pass never began for
the DDP. Before, in the ``no_sync`` pass the DDP took it for a forward pass whose output
needed no backward (legal), rank 1 went on to step 3, and its synchronised pass met its
peers' of step 2: those reduced rank 1's step-3 micro-batches with their own step-2 ones,
silently, and every later step likewise, one step apart (PyTorch's DDP does the same).
Under ``join()`` either pass was taken for a forward pass left without its backward: a
misuse error on rank 1, the others' join contexts timed out. Now the exception, noted as
it left autograd (:mod:`xgrad.torch_backend.ddp_cut_short`), is posted at rank 1's next
forward pass like any pass cut short, and every rank raises it in step 2.

Checked: every rank raises at step 2 (rank 1 its own exception, the others a
``RankError`` naming rank 1 and the exception; a rank that had joined as it leaves
``join()``), every other step's gradients are those of its own micro-batches on every
rank still training (computed here from every rank's inputs), and the noting does not
misfire: at step 1 a backward of another graph raises on rank 1 between the DDP's
forward pass and its backward, which then runs, and the step trains; and a backward
raising on another thread while a pass awaits its backward on the main thread (every
rank left it without one, legal) fails no step (it did, with a warning, while any
thread's exception was noted on every pass when no other backward call was under way).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from ranks import every_rank_ok

WORLD = 3
AT = 2
#: scenario: (the pass whose backward raises at step AT on rank 1, under join() with
#: rank 0 out of inputs at step AT)
SCENARIOS = {
    "no_sync": ("no_sync", False),
    "no_sync, join": ("no_sync", True),
    "synchronised, join": ("synchronised", True),
}


def _inputs(rank: int, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def _expected(model: Any, step: int, training: list[int]) -> list[Any]:
    """The step's gradients: each training rank's two micro-batches, divided by the world
    size (``join()``'s default divides by the initial one)."""
    import copy

    ref = copy.deepcopy(model)
    ref.zero_grad()
    for rank in training:
        for x in _inputs(rank, step):
            (ref(x).square().mean() / WORLD).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _run(rank: int, world: int, failing: str, joined: bool) -> dict[str, Any]:
    import contextlib

    import torch
    from torch import nn

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, timeout=3.0)
    steps = AT if joined and rank == 0 else 5

    def boom(grad: Any) -> Any:
        raise ValueError(f"boom on rank {rank}")

    def backward(out: Any, fail: bool) -> None:
        if fail:
            out.register_hook(boom)
        out.square().mean().backward()

    raised: dict[int, str] = {}
    grads: dict[int, list[Any]] = {}
    context = ddp.join() if joined else contextlib.nullcontext()
    try:
        with context:
            for i in range(steps):
                first, second = _inputs(rank, i)
                ddp.zero_grad()
                try:
                    with ddp.no_sync():
                        out = ddp(first)
                        if i == 1 and rank == 1:  # another graph's backward raises
                            other = torch.ones(2, requires_grad=True) * 2
                            other.register_hook(boom)
                            with contextlib.suppress(ValueError):
                                other.sum().backward()
                        backward(out, i == AT and rank == 1 and failing == "no_sync")
                    backward(ddp(second), i == AT and rank == 1 and failing == "synchronised")
                    grads[i] = [p.grad.clone() for p in model.parameters()]
                except (RankError, ValueError) as exc:
                    raised[i] = f"{type(exc).__name__}: {exc}"
    except RankError as exc:  # a rank that had joined: the failure, as it leaves
        raised[-1] = f"{type(exc).__name__}: {exc}"
    right = {}
    for i, got in grads.items():
        training = [r for r in range(world) if not (joined and r == 0 and i >= AT)]
        expected = _expected(model, i, training)
        right[i] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True))
    return {"raised": raised, "right": right}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def runs(request: pytest.FixtureRequest) -> tuple[str, dict[int, Any]]:
    failing, joined = SCENARIOS[request.param]
    run = functools.partial(_run, failing=failing, joined=joined)
    return request.param, every_rank_ok(run, WORLD, timeout=120)


def test_every_rank_raises_the_exception_at_its_step(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    assert results[1]["raised"] == {AT: "ValueError: boom on rank 1"}, (name, results[1])
    joined = SCENARIOS[name][1]
    for rank in (0, 2):
        raised = results[rank]["raised"]
        at = -1 if joined and rank == 0 else AT
        assert list(raised) == [at], (name, rank, raised)
        assert "rank 1 in backward" in raised[at] and "boom on rank 1" in raised[at], (name, rank)


def test_every_other_step_has_its_own_gradients(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    for rank, result in results.items():
        right = result["right"]
        steps = AT if SCENARIOS[name][1] and rank == 0 else 5
        assert sorted(right) == [i for i in range(steps) if i != AT], (name, rank, right)
        assert all(right.values()), (name, rank, right)


def _other_thread(rank: int, world: int) -> dict[str, Any]:
    """Each rank runs a forward pass with gradients on and no backward (legal on every
    rank: a validation loss), while another thread's backward of its own graph raises;
    then trains a step."""
    import contextlib
    import threading
    import warnings

    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, timeout=3.0)
    x = _inputs(rank, 0)[0]
    ddp(x).square().mean()  # its backward never comes, on every rank

    def boom(grad: Any) -> Any:
        raise ValueError("another graph")

    def other() -> None:
        y = torch.ones(2, requires_grad=True) * 2
        y.register_hook(boom)
        with contextlib.suppress(ValueError):
            y.sum().backward()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return {"error": error, "warned": warned, "grad": model.weight.grad.clone()}


def test_another_threads_backward_raising_fails_no_pass_of_this_one() -> None:
    # The pass awaiting its backward ran its forward on the main thread; the exception
    # left another thread's backward call: not this pass's (ddp_cut_short), so the skip
    # that every rank made is settled as legal (no failed step: no warning of one) and
    # the next step trains.
    results = every_rank_ok(_other_thread, 2, timeout=120)
    assert [r["error"] for r in results.values()] == ["", ""], results
    assert [r["warned"] for r in results.values()] == [[], []], results
    import torch

    assert torch.equal(results[0]["grad"], results[1]["grad"])
