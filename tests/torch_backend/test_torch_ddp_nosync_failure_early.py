"""A ``no_sync`` pass that raises early in a step of several, with a ``try`` per micro-batch.

Three gloo ranks; each step accumulates ``micro - 1`` ``no_sync`` micro-batches, then runs
a synchronised one. At step 2, rank 1's pass of micro-batch ``k`` (not the
step's last ``no_sync`` one) raises: in its forward pass, in its backward pass before any
of DDP's gradient hooks (a hook on the output), or between the layers (after DDP's hooks
of the last layer). The loop catches it per micro-batch and goes on with the step's next
micro-batches, or per step and goes on with the next step.

Before, rank 1's next ``no_sync`` pass gave the step up and was taken for the next step's
first pass in either loop: with a ``try`` per micro-batch, rank 1's synchronised pass of
step 2 then met its peers' of step 3, and from there every step reduced rank 1's
micro-batches with theirs of the step before, silently, on every rank, until the last
step timed out. Now the rank that gave a step up counts its passes until its next
synchronised one, and compares them with the most ``no_sync`` passes a peer made in that
step (posted as each begins the next): as many, it is the failed step's synchronised
pass and raises the failure there; else the next step's
(:mod:`xgrad.torch_backend.ddp_which_step`).

Checked: every rank raises in the failing step only (rank 1 its own exception at the
failing micro-batch and, per micro-batch, the failure again at its synchronised pass;
the others a ``RankError`` naming rank 1), and every other step's gradients are those of
its own micro-batches (computed here from every rank's inputs), in both loops; also with
two ranks failing at different micro-batches of the step, with
``find_unused_parameters``, and with a ``try`` per step whose next step is shorter. The loops
with a ``try`` per step passed before too: they guard that a ``no_sync`` pass after the
failure is still the next step's there. Under ``join()`` the loop is refused, saying what
to do; one rank trains on."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest
from ranks import every_rank_ok

WORLD = 3
AT = 2
STEPS = 5


class Case(NamedTuple):
    """Micro-batches per step, the failing micro-batch of each failing rank, where it
    raises, a ``try`` per micro-batch (else per step), ``find_unused_parameters``, the
    failing step, and the micro-batches of the step after it (``None``: ``micro``)."""

    micro: int
    ats: dict[int, int]
    where: str
    per_micro: bool
    unused: bool = False
    at: int = AT
    after: int | None = None

    def size(self, step: int) -> int:
        return self.after if step == self.at + 1 and self.after is not None else self.micro


SCENARIOS = {
    "forward, per micro-batch": Case(3, {1: 0}, "forward", True),
    "before DDP, per micro-batch": Case(3, {1: 0}, "output", True),
    "between layers, per micro-batch": Case(4, {1: 1}, "between", True),
    "two ranks, per micro-batch": Case(4, {1: 0, 2: 1}, "between", True),
    "unused parameters, per micro-batch": Case(3, {1: 0}, "between", True, unused=True),
    "between layers, per step": Case(3, {1: 0}, "between", False),
    "before DDP, per step": Case(4, {1: 0}, "output", False),
    "a shorter step next, per step": Case(4, {1: 0}, "between", False, after=2),
}


def _inputs(rank: int, step: int, micro: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(3, 4, generator=g)


def _expected(model: Any, step: int, micro: int, world: int) -> list[Any]:
    import copy

    ref = copy.deepcopy(model)
    ref.zero_grad()
    for rank in range(world):
        for k in range(micro):
            (ref(_inputs(rank, step, k)).square().mean() / world).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _run(rank: int, world: int, case: Case) -> Any:
    import contextlib

    import torch
    from torch import nn

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ddp = DistributedDataParallel(model, timeout=3.0, find_unused_parameters=case.unused)
    fail = {"on": False}

    def boom(*_: Any) -> Any:
        if fail["on"]:
            fail["on"] = False
            raise ValueError(f"boom on rank {rank}")
        return None

    if case.where == "forward":
        model[2].register_forward_pre_hook(boom)
    elif case.where == "between":

        def between(module: Any, inputs: Any, output: Any) -> None:
            output.register_hook(boom)

        model[1].register_forward_hook(between)

    def one(step: int, k: int) -> None:
        fail["on"] = step == case.at and case.ats.get(rank) == k
        sync = k == case.size(step) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            out = ddp(_inputs(rank, step, k))
            if case.where == "output":
                out.register_hook(boom)
            out.square().mean().backward()

    raised: dict[str, str] = {}
    right: dict[int, bool] = {}
    for step in range(STEPS):
        ddp.zero_grad()
        ok = True
        for k in range(case.size(step)):
            try:
                one(step, k)
            except (RankError, ValueError) as exc:
                raised[f"{step}.{k}"] = f"{type(exc).__name__}: {exc}"
                ok = False
                if not case.per_micro:
                    break
        if ok:
            expected = _expected(model, step, case.size(step), world)
            got = [p.grad for p in model.parameters()]
            right[step] = all(
                torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True)
            )
    # the failed step's keys, deleted by the lowest rank once every rank read them
    # (the rank that placed its passes marks that after reading the counts)
    return {"raised": raised, "right": right, "kept": len(ddp._watch.failed_steps)}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def runs(request: pytest.FixtureRequest) -> tuple[str, dict[int, Any]]:
    run = functools.partial(_run, case=SCENARIOS[request.param])
    return request.param, every_rank_ok(run, WORLD, timeout=120)


def test_every_rank_raises_the_failure_in_its_step(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    case = SCENARIOS[name]
    last = f"{case.at}.{case.micro - 1}"
    named = tuple(f"RankError: rank {r} in " for r in case.ats)
    for rank, result in results.items():
        raised = dict(result["raised"])
        if rank in case.ats:
            first = raised.pop(f"{case.at}.{case.ats[rank]}")
            assert f"boom on rank {rank}" in first, (name, rank, first)
            if case.where == "forward":
                assert first.startswith("RankError") and f"rank {rank} in forward" in first
            if not case.per_micro:
                assert raised == {}, (name, rank, raised)
                continue
        # a peer, or a failing rank's synchronised pass of the failed step (a try per
        # micro-batch), raises the step's failure there
        assert list(raised) == [last], (name, rank, raised)
        assert raised[last].startswith(named) and "boom on rank" in raised[last], (name, rank)


def test_every_other_step_has_its_own_gradients(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    at = SCENARIOS[name].at
    for rank, result in results.items():
        right = result["right"]
        assert sorted(right) == [i for i in range(STEPS) if i != at], (name, rank, right)
        assert all(right.values()), (name, rank, right)
        assert result["kept"] == 0, (name, rank, result["kept"])


def _under_join(rank: int, world: int) -> dict[str, str]:
    """The loop with a ``try`` per micro-batch under ``join()``, no rank joined; every
    exception kept by where it came from."""
    import contextlib
    import warnings

    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    warnings.simplefilter("ignore", RuntimeWarning)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2), timeout=3.0)
    raised: dict[str, str] = {}

    def boom(grad: Any) -> Any:
        raise ValueError("boom")

    with ddp.join():
        for step in range(AT + 2):
            for k in range(3):
                try:
                    with contextlib.nullcontext() if k == 2 else ddp.no_sync():
                        out = ddp(_inputs(rank, step, k))
                        if step == AT and rank == 1 and k == 0:
                            out.register_hook(boom)
                        out.square().mean().backward()
                except Exception as exc:
                    raised[f"{step}.{k}"] = f"{type(exc).__name__}: {exc}"
    return raised


def test_under_join_a_try_per_micro_batch_is_refused_with_what_to_do() -> None:
    """Under ``join()`` every pass is counted with the peers', and the failing rank stands
    in for the failed step's synchronised pass at its next pass (:mod:`.join_rounds`): a
    loop that goes on with the step's remaining micro-batches runs its passes out of step
    with its peers' from there on. Not placed as outside ``join()``; every rank raises at
    once, saying what to do, instead of reducing mismatched passes."""
    results = every_rank_ok(_under_join, WORLD, timeout=120)
    for rank, raised in results.items():
        later = [text for where, text in raised.items() if "different forward passes" in text]
        assert later, (rank, raised)
        assert all("end the accumulation on an error" in text for text in later), (rank, later)
        assert all(int(where.split(".")[0]) >= AT for where in raised), (rank, raised)


def test_one_rank_trains_on_after_the_failure() -> None:
    """With one rank there is no peer's step to pair with (and no count to read): the
    pass after the failure trains as before (it raised "max() arg is an empty sequence"
    at the synchronised pass)."""
    run = functools.partial(_run, case=Case(3, {0: 0}, "between", True))
    result = every_rank_ok(run, 1, timeout=60)[0]
    assert list(result["raised"]) == [f"{AT}.0"], result
    assert "boom on rank 0" in result["raised"][f"{AT}.0"], result
    assert sorted(result["right"]) == [i for i in range(STEPS) if i != AT], result
    assert all(result["right"].values()), result
