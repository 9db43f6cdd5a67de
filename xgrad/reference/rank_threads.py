"""Running a function on N simulated ranks, one thread each: :func:`spawn` and its errors.

A rank's thread calls ``fn`` with its :class:`~xgrad.reference.comm.ReferenceComm`; a rank
that raises aborts the :class:`~xgrad.reference.comm.World`, so the others stop waiting,
and :func:`spawn` raises :class:`RankError` for the rank whose own error it was. Kept apart
from :mod:`xgrad.reference.comm` (the collectives the ranks share, which still exports these
names) because starting, joining and blaming threads is a job of its own.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from xgrad.reference.blas import single_threaded_blas
from xgrad.reference.clock import LinkModel
from xgrad.reference.comm import DEFAULT_TIMEOUT_S, ReferenceComm, World

__all__ = ["MAX_RANKS", "RankError", "spawn"]

T = TypeVar("T")

#: The most simulated ranks :func:`spawn` starts: one OS thread each, all in this process
#: under one GIL, every collective a rendezvous of them all. Far past this a run took
#: minutes only to end in "can't start new thread" (the process's thread limit); refusing
#: up front names the cause instead.
MAX_RANKS = 1024


class RankError(RuntimeError):
    """A simulated rank raised; ``rank`` says which, ``__cause__`` is its error."""

    def __init__(self, rank: int, error: BaseException, note: str = "") -> None:
        self.rank = rank
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}{note}")


def spawn(
    fn: Callable[[ReferenceComm], T],
    world_size: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    link: LinkModel | None = None,
    flops_per_second: float = 1e12,
    world: World | None = None,
) -> list[T]:
    """Run ``fn(comm)`` on ``world_size`` simulated ranks (threads); results by rank.

    The argument order is the torch backend's ``spawn(fn, world_size)`` (and
    ``torch.multiprocessing.spawn``'s); the older ``spawn(world_size, fn)`` still works,
    with a ``DeprecationWarning``.

    Raises:
        RankError: for the first rank (lowest number) that failed with its own error
            rather than because another rank aborted the world; chained to that error.
    """
    if isinstance(fn, int) and callable(world_size):
        warnings.warn(
            "spawn(world_size, fn) is deprecated: call spawn(fn, world_size)",
            DeprecationWarning,
            stacklevel=2,
        )
        fn, world_size = world_size, fn
    if world_size > MAX_RANKS:
        raise ValueError(
            f"world_size={world_size} is more than the reference backend's {MAX_RANKS} "
            "simulated ranks (one thread each, in this process)"
        )
    w = (
        world
        if world is not None
        else World(world_size, timeout=timeout, link=link, flops_per_second=flops_per_second)
    )
    if w.size != world_size:
        raise ValueError(f"world has size {w.size}, not world_size={world_size}")
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(w.comm(rank))
        except BaseException as err:
            errors[rank] = err
            w.abort(rank, f"{type(err).__name__}: {err}")

    threads = [
        threading.Thread(target=body, args=(r,), name=f"xgrad-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    with single_threaded_blas():
        for t in threads:
            t.start()
        stuck = _join_ranks(threads, w)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        own = [(r, e) for r, e in failed if "collective aborted because rank" not in str(e)]
        rank, err = (own or failed)[0]
        note = (
            f" (ranks {stuck} were still running {w.timeout:g} s after the world was "
            "aborted, outside any collective, where the abort cannot reach them; their "
            "threads are left behind)"
            if stuck
            else ""
        )
        raise RankError(rank, err, note) from err
    return results


def _join_ranks(threads: list[threading.Thread], world: World) -> list[int]:
    """Wait for every rank's thread; the ranks still running when given up on.

    A rank that runs long in its own code is waited for as long as it runs, as a process
    would be. Once the world is aborted (a rank failed, a collective timed out) every
    rank waiting in a collective stops at once, but one busy outside any collective
    cannot be reached: the others get the world's ``timeout`` more, not forever, so the
    failure is raised instead of a hang.
    """
    deadline: float | None = None
    for t in threads:
        while t.is_alive():
            now = time.monotonic()
            if deadline is None and world.aborted:
                deadline = now + world.timeout
            if deadline is not None and now >= deadline:
                return [r for r, other in enumerate(threads) if other.is_alive()]
            t.join(0.05 if deadline is None else min(0.05, deadline - now))
    return []
