"""The scaffolding the ``join()`` failure tests share: a join context run and recorded, and
the checks of what it trained.

Each of those tests runs several join contexts (its scenarios) in one multi-process run,
records each the same way (every step's gradients or error, how the rank left
``join()``, how long it took), then checks the gradients against each rank's own
gradient or against PyTorch's DDP. Held here once, so that a test file keeps only its
scenarios and the assertions particular to them. The rank-side helpers run in the rank
processes and import torch there, as the rank bodies do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

#: a join context's record: ``steps`` (each step's value, or its error as text), ``left``
#: (``"left"``, or the error it left ``join()`` with) and ``seconds``
Run = dict[str, Any]


def caught(exc: BaseException) -> str:
    """An error as the records keep it: its type's name and its text."""
    return f"{type(exc).__name__}: {exc}"


def first_line(exc: BaseException) -> str:
    """:func:`caught`, its first line (a failure's "also ..." lines left out)."""
    return caught(exc).splitlines()[0]


def met_by_all(rank: int) -> float:
    """An all-reduce of ``rank + 1`` on the default group, after the contexts: every rank
    gets ``world * (world + 1) / 2`` only where no collective was left unpaired."""
    import torch
    import torch.distributed as dist

    total = torch.full((1,), float(rank + 1))
    dist.all_reduce(total)
    return float(total.item())


def grads(models: Sequence[Any]) -> list[Any]:
    """The gradients of every parameter of ``models``, in order, as arrays (one step's
    record: the tests compare them across ranks after the run)."""
    return [p.grad.clone().numpy() for m in models for p in m.parameters()]


def run_context(
    context: Callable[[], AbstractContextManager[Any]], body: Callable[[list[Any]], None]
) -> Run:
    """Run ``body(steps)`` in the context ``context()`` makes; the context's record.

    A ``RuntimeError`` out of the context (a ``RankError`` raised as a rank leaves
    ``join()``, say) is recorded as ``left``, not raised: the tests check it, and the
    rank goes on to its next scenario.
    """
    steps: list[Any] = []
    started = time.monotonic()
    try:
        with context():
            body(steps)
        left = "left"
    except RuntimeError as exc:
        left = caught(exc)
    return {"steps": steps, "left": left, "seconds": time.monotonic() - started}


def run_steps(
    context: Callable[[], AbstractContextManager[Any]],
    count: int,
    step: Callable[[int], Any],
    *,
    catch: tuple[type[BaseException], ...] | None = None,
    on_error: Callable[[], None] | None = None,
    reraise: bool = False,
) -> Run:
    """:func:`run_context` of ``count`` steps, each ``step(i)``'s value recorded.

    A step that raises one of ``catch`` (by default ``RankError`` and ``ValueError``: the
    failed step's error on every rank, the failing rank's own) is recorded as its text
    and the rank goes on, as a user catching a failure per step does; then ``on_error()``
    runs (a pass right after the failed step, say), and with ``reraise`` the error is
    raised again, out of ``join()``.
    """
    if catch is None:
        from xgrad.failure_errors import RankError

        catch = (RankError, ValueError)

    def body(steps: list[Any]) -> None:
        for i in range(count):
            try:
                steps.append(step(i))
            except catch as exc:
                steps.append(caught(exc))
                if on_error is not None:
                    on_error()
                if reraise:
                    raise

    return run_context(context, body)


def all_ended(store: Any, key: str, rank: int, world: int) -> None:
    """Wait, idle but alive, until every rank has ended scenario ``key`` (none runs a DDP
    step meanwhile): a rank that raised out of ``join()`` stays for the others' checks."""
    from datetime import timedelta

    store.set(f"{key}/{rank}", b"1")
    store.wait([f"{key}/{r}" for r in range(world)], timedelta(seconds=60))


def two_linear_ddps(rank: int, timeout: float) -> tuple[list[Any], list[Any], list[Any]]:
    """Three batches of this rank, and two DDPs of ``Linear(5, 5)`` and ``Linear(5, 2)``
    (seed 0), xgrad's (``timeout``) and PyTorch's, each over its own copy of the modules:
    ``(data, [ours, d1, d2], [theirs, t1, t2])``, the tests of two DDPs in one ``Join``
    comparing the two sides."""
    import copy

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = [nn.Linear(5, 5), nn.Linear(5, 2)]
    g = torch.Generator().manual_seed(10 + rank)
    data = [torch.randn(4, 5, generator=g) for _ in range(3)]
    ours = [copy.deepcopy(m) for m in base]
    d1, d2 = (DistributedDataParallel(m, timeout=timeout) for m in ours)
    theirs = [copy.deepcopy(m) for m in base]
    t1, t2 = (TorchDDP(m) for m in theirs)
    return data, [ours, d1, d2], [theirs, t1, t2]


def nosync_step(ddp: Any, x: Any, passes: int, fail: bool, armed: list[bool]) -> str:
    """One step of ``passes`` ``no_sync`` passes, then a synchronised one; with ``fail``,
    the first ``no_sync`` pass's forward raises (through ``armed``, an
    :func:`ranks.armed_linear`'s). ``"ok"`` when it trained."""
    for k in range(passes):
        with ddp.no_sync():
            armed[0] = fail and k == 0
            ddp(x).pow(2).mean().backward()
    ddp(x).pow(2).mean().backward()
    return "ok"


def trained_after(
    sides: Sequence[tuple[str, Sequence[Any], Sequence[Any], Callable[[], Any]]],
    x: Any,
    rank: int,
    accumulate: Callable[[int], int],
    loss: Callable[[Any], Any],
) -> dict[str, list[Any]]:
    """A join context after the failures, on each side: ``(side, ddps, models, context)``.

    Rank ``r`` runs ``r + 1`` steps; step ``i`` runs ``accumulate(i)`` ``no_sync`` passes
    then a synchronised one, through every DDP in turn, on ``x * (i + 1)``. Each side's
    steps' gradients, by side: xgrad's against PyTorch's from the same parameters shows
    the failures left nothing behind.
    """
    out: dict[str, list[Any]] = {}
    for side, ddps, models, context in sides:
        out[side] = []
        with context():
            for i in range(1 + rank):
                for m in models:
                    m.zero_grad()
                for _ in range(accumulate(i)):
                    for d in ddps:
                        with d.no_sync():
                            loss(d(x * (i + 1))).backward()
                for d in ddps:
                    loss(d(x * (i + 1))).backward()
                out[side].append(grads(models))
    return out


def two_passes(i: int) -> int:
    """Step ``i``'s passes in the accumulation tests: a ``no_sync`` one, then the
    synchronised one, which reduces what both left (:func:`check_grads`' ``passes``)."""
    return 2


def check_raised_once(
    run: Run, batches: int, at: int, boom: str, label: Any, *, limit: float, named: bool = True
) -> None:
    """A rank's record of a context whose step ``at`` failed (``boom`` names the failure).

    Within ``limit`` seconds (no timeout waited out), a step recorded per batch. A rank
    with ``batches`` over ``at`` ran the step: it raised there, once, naming the failure
    (unless not ``named``: the failing rank's own autograd error), and left ``join()``
    plainly; a rank that had joined before it raises it as it leaves ``join()``.
    """
    steps = run["steps"]
    assert run["seconds"] < limit, (label, run)
    assert len(steps) == batches, (label, run)
    errors = [i for i, s in enumerate(steps) if isinstance(s, str)]
    if batches > at:
        assert errors == [at], (label, run)
        if named:
            assert boom in steps[at], (label, run)
        assert run["left"] == "left", (label, run)
    else:
        assert errors == [], (label, run)
        assert run["left"].startswith("RankError") and boom in run["left"], (label, run)


def check_grads(
    results: dict[int, Any],
    world: int,
    name: str,
    batches: Sequence[int],
    *,
    passes: Callable[[int], int] = lambda i: 1,
    atol: float = 1e-6,
) -> None:
    """Every step of context ``name`` that did not fail trained with ``join()``'s gradients.

    Step ``i``'s gradients, on every rank: the ``"local"`` gradients (each rank's own, of
    one pass) of the ranks with a batch at that step, summed, times the step's
    ``passes(i)`` (a ``no_sync`` step reduces all it accumulated), over the world size.
    """
    for rank, result in results.items():
        for i, got_step in enumerate(result[name]["steps"]):
            if isinstance(got_step, str):  # the failed step's error
                continue
            training = [r for r in results if i < batches[r]]
            for j, got in enumerate(got_step):
                want = passes(i) * sum(results[r]["local"][j] for r in training) / world
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=atol, err_msg=f"{name} rank {rank} step {i}"
                )


def check_trained(
    results: dict[int, Any],
    world: int,
    name: str,
    batches: Sequence[int],
    *,
    passes: Callable[[int], int] = lambda i: 1,
    limit: float | None = None,
) -> None:
    """Context ``name``, where nothing failed, trained on every rank: left plainly (within
    ``limit`` seconds, where given), a step per batch, each with :func:`check_grads`'s
    gradients (the failures before it left nothing behind)."""
    for rank, result in results.items():
        run = result[name]
        assert run["left"] == "left" and len(run["steps"]) == batches[rank], (name, rank, run)
        assert all(not isinstance(s, str) for s in run["steps"]), (name, rank, run)
        if limit is not None:
            assert run["seconds"] < limit, (name, rank, run)
    check_grads(results, world, name, batches, passes=passes)


def check_same(ours: list[Any], theirs: list[Any], what: str, *, rtol: float = 1e-5) -> None:
    """Two sides' steps, each a list of gradients, the same step for step."""
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-6, err_msg=f"{what} step {i}")


def check_as_pytorch(
    results: dict[int, Any], name: str, reference: str, *, limit: float | None = None
) -> None:
    """Context ``name`` (xgrad's) and ``reference`` (PyTorch's, from the same parameters)
    left plainly on every rank (``name`` within ``limit`` seconds, where given) and
    trained the same, step for step."""
    for rank, result in results.items():
        ours, theirs = result[name], result[reference]
        assert ours["left"] == theirs["left"] == "left", (rank, ours, theirs)
        if limit is not None:
            assert ours["seconds"] < limit, (rank, ours)
        check_same(ours["steps"], theirs["steps"], f"{name} rank {rank}")


def check_after_as_pytorch(results: dict[int, Any], *, rtol: float) -> None:
    """Every rank's :func:`trained_after` (kept as ``"after"``): a step per rank number
    and one more, xgrad's as PyTorch's."""
    for rank, result in results.items():
        ours, theirs = result["after"]["xgrad"], result["after"]["torch"]
        assert len(ours) == len(theirs) == rank + 1
        check_same(ours, theirs, f"rank {rank}", rtol=rtol)
