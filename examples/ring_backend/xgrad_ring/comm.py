"""Ring collectives between threads: each rank sends only to its right neighbour.

An allreduce splits the buffer in ``size`` chunks; after ``size - 1`` reduce-scatter steps
rank ``r`` holds the full sum of chunk ``(r + 1) % size``, and ``size - 1`` all-gather
steps hand every sum around, so every rank ends with the same bits. Every message carries
the collective's number and kind: a rank that calls a different collective than its
neighbour gets an error naming both. Every wait is bounded by the world's timeout, and a
rank that fails wakes the others at once.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


class RingError(RuntimeError):
    """A ring collective failed: a mismatch, a timeout, or another rank's failure."""


class _World:
    def __init__(self, size: int, timeout: float) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"world_size={size!r}: expected an int >= 1")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: expected seconds > 0")
        self.size = size
        self.timeout = timeout
        self.inboxes: list[queue.Queue[Any]] = [queue.Queue() for _ in range(size)]
        self.failed: str | None = None

    def abort(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
        for inbox in self.inboxes:
            inbox.put(None)  # wakes a waiting rank, which then sees `failed`


class _Done:
    """A finished collective (the ring runs it to the end before returning)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value


class RingComm:
    """One rank's end of the ring: an :class:`xgrad.backend.Comm`."""

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._seq = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def _send(self, tag: tuple[Any, ...], payload: Any) -> None:
        self._world.inboxes[(self._rank + 1) % self.size].put((self._rank, tag, payload))

    def _recv(self, tag: tuple[Any, ...]) -> Any:
        left = (self._rank - 1) % self.size
        try:
            message = self._world.inboxes[self._rank].get(timeout=self._world.timeout)
        except queue.Empty:
            raise RingError(
                f"rank {self._rank}: timed out after {self._world.timeout:g} s waiting for "
                f"rank {left} in collective {tag[0]} ({tag[1]})"
            ) from None
        if message is None:
            raise RingError(f"rank {self._rank}: collective aborted: {self._world.failed}")
        sender, their_tag, payload = message
        if their_tag[:3] != tag[:3]:
            raise RingError(
                f"rank {self._rank} called collective {tag[0]} as {tag[1]}{tag[2]} but rank "
                f"{sender} called it as {their_tag[1]}{their_tag[2]}"
            )
        return payload

    def _next(self) -> int:
        self._seq += 1
        return self._seq - 1

    def allreduce(self, buffer: Any) -> _Done:
        """SUM over the ring; returns a new array (the input is not written)."""
        flat = np.array(buffer, copy=True).reshape(-1)
        seq = self._next()
        tag = (seq, "allreduce", (flat.shape, flat.dtype.str))
        n, r = self.size, self._rank
        chunks = np.array_split(flat, n)  # views into `flat`
        for step in range(n - 1):  # reduce-scatter
            self._send((*tag, step), chunks[(r - step) % n].copy())
            part = self._recv((*tag, step))
            target = chunks[(r - step - 1) % n]
            target += part
        for step in range(n - 1):  # all-gather: pass the finished sums on
            self._send((*tag, n + step), chunks[(r + 1 - step) % n].copy())
            chunks[(r - step) % n][...] = self._recv((*tag, n + step))
        return _Done(flat.reshape(np.shape(buffer)))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj``, passed around the ring once."""
        if not 0 <= src < self.size:
            raise ValueError(f"src={src!r}: expected a rank in 0..{self.size - 1}")
        tag = (self._next(), "broadcast", (src,))
        data = pickle.dumps(obj) if self._rank == src else self._recv(tag)
        if (self._rank + 1) % self.size != src:
            self._send(tag, data)
        return obj if self._rank == src else pickle.loads(data)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` by rank: ``size - 1`` steps around the ring."""
        tag = (self._next(), "allgather", ())
        items: list[Any] = [None] * self.size
        items[self._rank] = obj
        for step in range(self.size - 1):
            origin = (self._rank - step) % self.size
            self._send(tag, (origin, pickle.dumps(items[origin])))
            got, data = self._recv(tag)
            items[got] = pickle.loads(data)
        return items


def run_ranks(
    fn: Callable[[RingComm], T], world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[T]:
    """``fn(comm)`` on ``world_size`` threads joined in a ring; results by rank.

    Raises:
        RingError: naming the first rank that failed with its own error (not because a
            failure elsewhere aborted it), chained to that error.
    """
    world = _World(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(RingComm(world, rank))
        except BaseException as err:
            errors[rank] = err
            world.abort(f"rank {rank} failed: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        own = [(r, e) for r, e in failed if "collective aborted" not in str(e)]
        rank, err = (own or failed)[0]
        raise RingError(f"rank {rank} failed: {type(err).__name__}: {err}") from err
    return results
