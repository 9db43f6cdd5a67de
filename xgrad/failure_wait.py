"""A bounded wait that watches a step's failure channel (:func:`wait_until`).

Apart from :mod:`xgrad.failure` (the channel itself) because it is the one piece that
spins: how soon a wait sees what it waits for, and how seldom it reads the channel, are
traded here. Backend-neutral, as the channel is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from xgrad.failure import FailureChannel, default_seconds

__all__ = ["wait_until"]

#: seconds :func:`wait_until` waits before it first reads the failure channel.
_FIRST_CHECK = 1e-3


def wait_until(
    done: Callable[[], bool] | threading.Event,
    channel: FailureChannel | None,
    *,
    timeout: float,
    what: str,
    poll_interval: float | None = None,
    prefix: str = "",
    peers: Sequence[int] | Callable[[], Sequence[int]] = (),
) -> None:
    """Wait until ``done`` is true, checking ``channel`` meanwhile; never longer than ``timeout``.

    ``done`` is an event (woken at once when set) or a cheap predicate (a store lookup,
    ``Work.is_completed``), called with sleeps of 50 to 200 µs for the first 10 ms (a
    peer's answer is usually that close) and up to 2 ms after, so a result is seen
    quickly and a long wait does not spin a core. The channel is read after 1 ms, then
    every ``poll_interval`` seconds (default ``XGRAD_POLL_INTERVAL`` or 0.02). ``peers``:
    the ranks the wait is for (a timeout names a live one that is late, see
    :meth:`FailureChannel.timed_out`), or a function giving them when the wait times out
    (a wait for many ranks: those still missing then, not every rank it began with).

    Raises:
        RankError: a failure posted by any rank of the channel, or a peer that stopped
            beating.
        RankUnresponsiveError: ``timeout`` ran out (posted to the channel first, so the
            others stop too); without a channel, a plain ``TimeoutError``.
    """
    event = done if isinstance(done, threading.Event) else None
    ready: Callable[[], bool] = event.is_set if event is not None else done  # type: ignore[assignment,union-attr]
    if ready():
        return
    interval = default_seconds("poll_interval") if poll_interval is None else poll_interval
    start = time.monotonic()
    deadline = start + timeout
    # The channel is first read after a millisecond, not at once: most waits end sooner
    # (a peer's answer is usually that close), and a read costs a store round trip or
    # more (the heartbeats), which delayed seeing what was waited for.
    next_check = start + min(interval, _FIRST_CHECK)
    nap = 5e-5
    while True:
        now = time.monotonic()
        if now >= next_check:
            if channel is not None:
                channel.check(prefix=prefix)
            next_check = now + interval
        if now >= deadline:
            if channel is None:
                raise TimeoutError(f"{what}: timed out after {timeout:g} s")
            late = peers() if callable(peers) else peers
            raise channel.timed_out(what, timeout, prefix=prefix, peers=late)
        if event is not None:
            event.wait(max(0.0, min(next_check, deadline) - now))
        else:
            time.sleep(nap)
            nap = min(nap * 2, 2e-4 if now - start < 0.01 else 2e-3)
        if ready():
            return
