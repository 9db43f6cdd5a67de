"""N ranks simulated in one process (threads), with exact, deterministic collectives.

Every rank numbers its collectives 0, 1, 2, ...; the ``k``-th collective of each rank is
matched with the ``k``-th of the others, and a mismatch (one rank broadcasting while
another reduces, or different shapes) is an error that names the ranks. Sums are taken
in rank order ``0 + 1 + ... + N-1`` by one rank and handed to all, so every rank sees the
same bits, run after run. Every wait is bounded by the world's ``timeout`` and a timeout
names the waiting rank and the ranks that never joined. A rank that fails aborts the
world, so the others stop waiting at once instead of timing out. The ranks' threads are
started and joined by :func:`~xgrad.reference.rank_threads.spawn`.
"""

from __future__ import annotations

import importlib
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from xgrad.reference.clock import LinkModel, VirtualClock

if TYPE_CHECKING:
    from xgrad.reference.rank_threads import RankError as RankError
    from xgrad.reference.rank_threads import spawn as spawn

DEFAULT_TIMEOUT_S = 60.0


class CollectiveError(RuntimeError):
    """A collective could not complete on some rank (mismatch, timeout, or abort)."""


@dataclass
class _Op:
    kind: str
    contributions: list[Any]
    launch_times: list[float]
    arrived: int = 0
    done: bool = False
    result: Any = None
    finish: float = 0.0
    consumed: int = 0
    waiting_on: set[int] = field(default_factory=set)


class World:
    """The shared state of ``size`` simulated ranks.

    Args:
        size: number of ranks.
        timeout: seconds any rank waits for the others in one collective.
        link: with a link model, the world keeps a :class:`VirtualClock` (``clock``) and
            allreduces cost modelled time; object collectives are control traffic and cost
            nothing.
        flops_per_second: the virtual clock's compute rate.
    """

    def __init__(
        self,
        size: int,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        link: LinkModel | None = None,
        flops_per_second: float = 1e12,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"world size={size!r} must be an int >= 1")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.size = size
        self.timeout = timeout
        self.clock = (
            None if link is None else VirtualClock(size, link, flops_per_second=flops_per_second)
        )
        self._cond = threading.Condition()
        self._ops: dict[int, _Op] = {}
        self._seq = [0] * size
        self._aborted: tuple[int, str] | None = None

    def comm(self, rank: int) -> ReferenceComm:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank={rank} is not in 0..{self.size - 1}")
        return ReferenceComm(self, rank)

    @property
    def aborted(self) -> bool:
        """Whether a rank failed (or a collective timed out): no collective completes now."""
        return self._aborted is not None

    def abort(self, rank: int, reason: str) -> None:
        """Rank ``rank`` failed: every rank waiting in a collective stops with an error."""
        with self._cond:
            if self._aborted is None:
                self._aborted = (rank, reason)
            self._cond.notify_all()

    # -- the collective machinery (all ranks share it) -------------------------------

    def _join(self, rank: int, kind: str, value: Any) -> int:
        """Contribute ``value`` to this rank's next collective; returns its number."""
        with self._cond:
            self._check_aborted(rank)
            seq = self._seq[rank]
            self._seq[rank] += 1
            op = self._ops.get(seq)
            if op is None:
                op = _Op(kind, [None] * self.size, [0.0] * self.size)
                self._ops[seq] = op
            if op.kind != kind:
                first = next(r for r, c in enumerate(op.contributions) if c is not None)
                msg = (
                    f"collective #{seq}: rank {rank} called {kind} but rank {first} called "
                    f"{op.kind}; every rank must issue the same collectives in the same order"
                )
                self._aborted = (rank, msg)
                self._cond.notify_all()
                raise CollectiveError(msg)
            op.contributions[rank] = value
            op.launch_times[rank] = self.clock.now(rank) if self.clock is not None else 0.0
            op.arrived += 1
            complete = op.arrived == self.size
        if complete:
            try:
                result, nbytes = self._combine(seq, op)
            except CollectiveError as err:
                self.abort(rank, str(err))
                raise
            finish = 0.0
            if self.clock is not None and kind == "allreduce":
                finish = self.clock.schedule_allreduce(op.launch_times, nbytes)
            with self._cond:
                op.result, op.finish, op.done = result, finish, True
                op.contributions = []
                self._cond.notify_all()
        return seq

    def _combine(self, seq: int, op: _Op) -> tuple[Any, int]:
        if op.kind == "allreduce":
            first = op.contributions[0]
            for r, c in enumerate(op.contributions):
                if c.shape != first.shape or c.dtype != first.dtype:
                    raise CollectiveError(
                        f"allreduce #{seq}: rank {r} gave shape {c.shape} dtype {c.dtype}, "
                        f"rank 0 gave shape {first.shape} dtype {first.dtype}"
                    )
            total = first.copy()
            for c in op.contributions[1:]:
                total += c  # rank order 0, 1, ..., N-1: the same bits every run
            return total, int(first.nbytes)
        if op.kind.startswith("broadcast:"):
            src = int(op.kind.split(":", 1)[1])
            return op.contributions[src], 0
        return list(op.contributions), 0

    def _result(self, rank: int, seq: int, what: str) -> tuple[Any, float]:
        """Wait (bounded) until collective ``seq`` completes; returns (result, finish time)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            op = self._ops[seq]
            while not op.done:
                self._check_aborted(rank)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.size) if self._seq[r] <= seq]
                    msg = (
                        f"rank {rank}: {what} (collective #{seq}) did not complete within "
                        f"{self.timeout}s; ranks {missing} never joined it"
                    )
                    self._aborted = (rank, msg)
                    self._cond.notify_all()
                    raise CollectiveError(msg)
                self._cond.wait(left)
            op.consumed += 1
            if op.consumed == self.size:
                del self._ops[seq]
            return op.result, op.finish

    def _check_aborted(self, rank: int) -> None:
        if self._aborted is not None:
            who, reason = self._aborted
            if who == rank:
                raise CollectiveError(reason)
            raise CollectiveError(
                f"rank {rank}: collective aborted because rank {who} failed: {reason}"
            )


class ReferenceWork:
    """An in-flight allreduce of one rank; :meth:`wait` writes the sum into its buffer."""

    def __init__(self, world: World, rank: int, seq: int, buffer: np.ndarray) -> None:
        self._world = world
        self._rank = rank
        self._seq = seq
        self._buffer = buffer
        self._done = False

    def wait(self) -> np.ndarray:
        """Block (bounded) until every rank joined; the buffer then holds the sum."""
        if not self._done:
            result, finish = self._world._result(self._rank, self._seq, "allreduce")
            np.copyto(self._buffer, result)
            if self._world.clock is not None:
                self._world.clock.wait_until(self._rank, finish)
            self._done = True
        return self._buffer


class ReferenceComm:
    """One rank's view of a :class:`World`: the :class:`~xgrad.backend.Comm` protocol."""

    def __init__(self, world: World, rank: int) -> None:
        self._world = world
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    @property
    def world(self) -> World:
        return self._world

    def now(self) -> float:
        """This rank's virtual time (0.0 without a link model)."""
        clock = self._world.clock
        return 0.0 if clock is None else clock.now(self._rank)

    def allreduce(self, buffer: Any) -> ReferenceWork:
        """Start a SUM of ``buffer`` over ranks; ``wait()`` writes it in place and returns it.

        The buffer's value is taken now (a copy), so later writes to it do not leak into
        the sum, as with a real asynchronous collective that was already enqueued.
        """
        if not isinstance(buffer, np.ndarray):
            raise TypeError(
                f"rank {self._rank}: allreduce takes a numpy array, got {type(buffer).__name__}"
            )
        seq = self._world._join(self._rank, "allreduce", np.array(buffer, copy=True))
        return ReferenceWork(self._world, self._rank, seq, buffer)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not 0 <= src < self.size:
            raise ValueError(
                f"rank {self._rank}: broadcast_object src={src} not in 0..{self.size - 1}"
            )
        seq = self._world._join(self._rank, f"broadcast:{src}", pickle.dumps(obj))
        data, _ = self._world._result(self._rank, seq, "broadcast_object")
        return pickle.loads(data)

    def allgather_object(self, obj: Any) -> list[Any]:
        seq = self._world._join(self._rank, "allgather", pickle.dumps(obj))
        data, _ = self._world._result(self._rank, seq, "allgather_object")
        return [pickle.loads(d) for d in data]

    def barrier(self) -> None:
        """Wait until every rank got here (an allgather of nothing)."""
        self.allgather_object(None)


#: names defined in :mod:`xgrad.reference.rank_threads` (which imports this module), still
#: importable from here.
_MOVED = {"RankError": "xgrad.reference.rank_threads", "spawn": "xgrad.reference.rank_threads"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'xgrad.reference.comm' has no attribute {name!r}")
