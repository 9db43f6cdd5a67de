"""One failure channel for every distributed step: an error anywhere is raised everywhere.

A distributed step (a backward pass across processes, a DDP iteration, a pipeline step)
must not leave peers waiting for a rank that failed. Each step gets a
:class:`FailureChannel`: a namespace in a small key-value store that every rank can
reach out of band (the c10d store in the torch backend, :class:`MemoryStore` in one
process). The first rank to fail posts a :class:`Failure` there; every other rank polls
the channel while it waits and raises the same failure, naming the rank and where it
started::

    rank 1 in MulBackward0: ValueError: boom
    rank 1 in comm hook, bucket 0: RuntimeError: ...
    rank 1: 1F3 failed: ...

A rank that dies or freezes cannot post anything, so every rank also bumps a heartbeat
counter (:mod:`xgrad.heartbeat`); a waiter whose peers' counters stop moving posts an
"unresponsive" failure naming them. Every wait is bounded
(:func:`xgrad.failure_wait.wait_until`). The records and errors are
:mod:`xgrad.failure_errors`'s, re-exported here.

All timeouts are seconds (a ``datetime.timedelta``, torch's form for every distributed
timeout, is read as its seconds), configurable per call, with defaults that environment variables
override (``XGRAD_TIMEOUT``, ``XGRAD_HEARTBEAT_INTERVAL``, ``XGRAD_HEARTBEAT_TIMEOUT``,
``XGRAD_POLL_INTERVAL``). This module is backend-neutral: it imports neither torch nor jax.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from xgrad.failure_errors import FAILURE_KINDS
from xgrad.failure_errors import Failure as Failure
from xgrad.failure_errors import RankError as RankError
from xgrad.failure_errors import RankUnresponsiveError as RankUnresponsiveError
from xgrad.failure_errors import describe as describe
from xgrad.failure_errors import error_for as error_for
from xgrad.failure_store import KeyValueStore as KeyValueStore
from xgrad.failure_store import MemoryStore as MemoryStore

if TYPE_CHECKING:
    from xgrad.heartbeat import Liveness

__all__ = [
    "Failure",
    "FailureChannel",
    "KeyValueStore",
    "MemoryStore",
    "RankError",
    "RankUnresponsiveError",
    "as_seconds",
    "check_seconds",
    "default_seconds",
    "describe",
    "error_for",
]

#: defaults (seconds) and the environment variables that override them.
DEFAULTS: dict[str, tuple[str, float]] = {
    # A whole wait (a receive, a collective, a pass): past it the step fails.
    "timeout": ("XGRAD_TIMEOUT", 60.0),
    # How often each process bumps its heartbeat.
    "heartbeat_interval": ("XGRAD_HEARTBEAT_INTERVAL", 0.5),
    # A rank whose heartbeat has not moved for this long is declared unresponsive
    # (died or froze) even before a wait's timeout.
    "heartbeat_timeout": ("XGRAD_HEARTBEAT_TIMEOUT", 10.0),
    # How often a waiter reads the channel (one store round trip each time).
    "poll_interval": ("XGRAD_POLL_INTERVAL", 0.02),
}


def as_seconds(value: object) -> object:
    """A ``datetime.timedelta`` as its seconds, anything else as it is (for the checks).

    torch gives every distributed timeout as a timedelta (``init_process_group``,
    ``new_group``, ``Work.wait``); a user who passed one here was refused as "not a number
    of seconds" before session 38.
    """
    return value.total_seconds() if isinstance(value, timedelta) else value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite float; a ``ValueError`` naming ``name`` otherwise
    (a ``TypeError`` for what is not a number: a string or a bool is not one, as for the
    DDP's ``timeout``). A timedelta counts as its seconds (:func:`as_seconds`)."""
    number: Any = as_seconds(value)
    if isinstance(number, (str, bytes, bool)):
        raise TypeError(f"{name}={value!r} must be a number of seconds")
    try:
        seconds = float(number)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} must be a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")
    return seconds


def default_seconds(name: str) -> float:
    """The default for ``name`` (a key of :data:`DEFAULTS`), or its environment override."""
    var, default = DEFAULTS[name]
    text = os.environ.get(var)
    if text is None or text == "":
        return default
    try:
        return check_seconds(var, float(text))
    except (TypeError, ValueError):
        raise ValueError(
            f"environment variable {var}={text!r} must be a positive number of seconds"
        ) from None


class FailureChannel:
    """The failures of one distributed step, in namespace ``prefix`` of a shared store.

    The first :meth:`post` wins: every rank that polls afterwards sees that failure (the
    same origin on every rank, even when several ranks fail at once).

    Args:
        store: the shared store.
        prefix: this step's namespace (e.g. one per distributed autograd context).
        rank: this process's rank (the origin of what it posts).
        liveness: heartbeats of the peers, for :meth:`check` to name a rank that stopped.
    """

    def __init__(
        self, store: KeyValueStore, prefix: str, rank: int, liveness: Liveness | None = None
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.liveness = liveness
        self._failure: Failure | None = None
        #: tickets this rank's posts took (their records are this rank's to delete).
        self.tickets: list[int] = []

    def post(
        self, where: str, message: str, *, kind: str = "error", rank: int | None = None
    ) -> Failure:
        """Report a failure (origin ``rank``, default this rank); returns the step's first one."""
        if self._failure is not None:
            return self._failure
        failure = Failure(self.rank if rank is None else rank, where, message, kind)
        ticket = self.store.add(f"{self.prefix}/failures", 1)
        self.tickets.append(ticket)
        self.store.set(f"{self.prefix}/failure/{ticket}", failure.to_bytes())
        if ticket == 1:
            self._failure = failure
            return failure
        return self._first() or failure

    def relay(self, failure: Failure) -> Failure:
        """Post another channel's ``failure`` as it is (its origin, place and kind: a dead
        rank stays "unresponsive"), not as this rank's; returns the step's first one."""
        return self.post(failure.where, failure.message, kind=failure.kind, rank=failure.rank)

    def written(self) -> list[str]:
        """The keys this rank's posts wrote and it alone may delete (once no rank reads the
        channel): its tickets' records, and the counter if it took ticket 1 (one rank did)."""
        keys = [f"{self.prefix}/failure/{t}" for t in self.tickets]
        return keys + ([f"{self.prefix}/failures"] if 1 in self.tickets else [])

    def poll(self) -> Failure | None:
        """The step's first failure, if any rank posted one (one store round trip)."""
        # A lookup, not a write: stores such as c10d's FileStore append every write.
        if self._failure is None and self.store.check([f"{self.prefix}/failure/1"]):
            self._failure = Failure.from_bytes(self.store.get(f"{self.prefix}/failure/1"))
        return self._failure

    def seen(self) -> Failure | None:
        """The step's first failure if this rank read (or posted) it already: no lookup."""
        return self._failure

    def others(self) -> list[Failure]:
        """The failures posted after the first, one per origin rank but the first's: those
        in the store now (lookups; a ticket whose failure is not written yet ends them).
        A note (a record of no failure kind, :data:`FAILURE_KINDS`) is none of them."""
        first = self.poll()
        found: list[Failure] = []
        ticket = 2
        while first is not None and self.store.check([key := f"{self.prefix}/failure/{ticket}"]):
            failure = Failure.from_bytes(self.store.get(key))
            named = {first.rank, *(f.rank for f in found)}
            if failure.kind in FAILURE_KINDS and failure.rank not in named:
                found.append(failure)
            ticket += 1
        return found

    def _first(self) -> Failure | None:
        # The poster of ticket 1 writes its record right after taking the ticket.
        key = f"{self.prefix}/failure/1"
        deadline = time.monotonic() + 1.0
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)
        self._failure = Failure.from_bytes(self.store.get(key))
        return self._failure

    def check(self, *, prefix: str = "", posted: bool = True) -> None:
        """Raise the step's failure if there is one; post one for a peer that stopped beating.

        ``posted=False``: a rank's error posted to the step is not raised, only a peer that
        stopped beating (a wait that must end past the step's failure: a join round)."""
        failure = self.poll()
        if not posted and failure is not None and failure.kind == "error":
            failure = None
        if failure is None and self.liveness is not None:
            self.liveness.read()
            stale = self.liveness.stale()
            if stale:
                failure = self._post_unresponsive(stale, self.liveness.timeout)
        if failure is not None:
            raise error_for(failure, self.rank, prefix)

    def timed_out(
        self,
        what: str,
        waited: float,
        *,
        prefix: str = "",
        collective: bool = False,
        peers: Sequence[int] = (),
    ) -> RankError:
        """The error for a wait on ``what`` that ran ``waited`` seconds: posted, then returned.

        Names the peers whose heartbeat stopped during the wait when there are any; else a
        live rank that waits for nobody (late, as its heartbeat publishes): for a
        ``collective`` any, else the one a wait for ``peers`` (the ranks it waited for)
        leads to, following whom each waits for (a rank busy in its own code, say a
        backward stuck in a user's function); this rank (as the one that gave up) otherwise.
        """
        stale: list[int] = []
        idle: list[int] = []
        answers = "every rank still answers"
        if self.liveness is not None:
            self.liveness.read(force=True)
            # A live rank's counter stands still for up to a beat interval, and more when
            # its machine is busy: a counter is only taken as stopped after two intervals.
            # A wait shorter than that cannot tell a stopped rank from a live one (a live
            # rank slower than a 0.3 s timeout was named as having stopped answering).
            least = 2 * self.liveness.interval
            short = waited / 2 < least
            if short:
                answers = (
                    f"too short a wait to tell from the heartbeats, every "
                    f"{self.liveness.interval:g} s, whether a rank stopped"
                )
            stale = self.liveness.stale(
                older_than=min(self.liveness.timeout, max(waited / 2, least)),
                include_silent=True,
            )
            # What a rank waits for is published once a beat too: a wait too short to
            # tell a stopped rank is too short to follow the waits.
            if not stale and collective:
                idle = self.liveness.idle()
            elif not stale and not short:
                idle = self._late_among(peers)
        if stale:
            failure = self._post_unresponsive(stale, waited, what)
        elif idle:
            if collective:
                message = (
                    f"did not answer within the timeout (rank {self.rank} waited for it in "
                    f"the collective): {what} timed out after {waited:g} s ({answers})"
                )
            else:
                message = (
                    f"did not answer within the timeout: rank {self.rank} waited {waited:g} s "
                    f"for it in {what} ({answers}; it waits for no rank: busy in its own "
                    "code, or not there yet)"
                )
            failure = self.post("", message, kind="timeout", rank=idle[0])
        else:
            failure = self.post(what, f"timed out after {waited:g} s ({answers})", kind="timeout")
        return error_for(failure, self.rank, prefix)

    def _late_among(self, peers: Sequence[int]) -> list[int]:
        """The live rank that waits for nobody at the end of a chain of waits from one of
        ``peers`` (empty when every chain comes back to a waiting rank: a deadlock)."""
        assert self.liveness is not None
        for peer in peers:
            end = self.liveness.end_of_waits(peer, self.rank)
            if end != self.rank and self.liveness.waits_of(end) is None:
                return [end]
        return []

    def _post_unresponsive(self, stale: Sequence[int], seconds: float, what: str = "") -> Failure:
        assert self.liveness is not None  # stale ranks are read from it
        waiting = f" while rank {self.rank} waited in {what}" if what else ""
        message = self.liveness.lost(stale, seconds, waiting)
        return self.post("", message, kind="unresponsive", rank=stale[0])


def __getattr__(name: str) -> Any:
    """``wait_until`` moved to :mod:`xgrad.failure_wait` (this module grew past 16 KB); code
    that imports it from here still gets it (imported late: that module imports this one)."""
    if name == "wait_until":
        from xgrad.failure_wait import wait_until

        return wait_until
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
