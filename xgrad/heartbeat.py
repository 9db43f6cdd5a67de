"""Heartbeats: each process bumps a counter in the shared store; a waiter names who stopped.

A rank that dies (SIGKILL) or freezes (SIGSTOP) cannot post its own failure; its
:class:`Heartbeat` thread stops too, and a :class:`Liveness` reader, polled by the
:class:`~xgrad.failure.FailureChannel` while a rank waits, names it. Backend-neutral:
written against :class:`~xgrad.failure.KeyValueStore`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence

from xgrad.failure import KeyValueStore, check_seconds, default_seconds

__all__ = ["ABORTED", "COLLECTIVE", "Heartbeat", "Liveness", "waiting_for"]

#: the rank this process's main wait is for (None: not waiting), published with the
#: heartbeat: a rank that timed out waiting for a live peer follows the peers' waits to the
#: rank that waits for nobody, the late one (:func:`waiting_for`).
_waiting: list[int | None] = [None]


#: what a process waiting in a collective publishes: it waits for every other rank of the
#: group, and a rank that times out there names one that waits for nobody (late for it).
COLLECTIVE = -1

#: added to its counter by a heartbeat stopped because its process aborted the group: the
#: peers read it with the counter (no more store calls) and name the abort at once, where
#: they named a rank that stopped answering, a heartbeat timeout later, or c10d's bare
#: "Wait timeout" or "Connection closed by peer".
ABORTED = 1 << 40


def waiting_for(rank: int | None) -> int | None:
    """Say which rank this process now waits for (``None``: none; :data:`COLLECTIVE`: all
    of a collective's); returns what it said before (to say again after a nested wait).
    Costs an assignment; the heartbeat thread publishes it at its next beat."""
    before, _waiting[0] = _waiting[0], rank
    return before


class Heartbeat:
    """A daemon thread bumping ``prefix/<rank>`` every ``interval`` seconds, so peers see it live.

    A frozen process (SIGSTOP) or a dead one stops bumping; a process busy in a long
    computation still does (the thread runs whenever the computation releases the GIL,
    which torch's kernels and c10d waits do).
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        rank: int,
        interval: float | None = None,
        *,
        beat_store: KeyValueStore | None = None,
    ) -> None:
        self.key = f"{prefix}/{rank}"
        self.interval = check_seconds(
            "heartbeat_interval",
            default_seconds("heartbeat_interval") if interval is None else interval,
        )
        #: the thread's store: ``beat_store`` when given (unguarded, see
        #: :func:`~xgrad.torch_backend.failure.start_heartbeat`), else ``store``.
        self._store = store if beat_store is None else beat_store
        self._stop = threading.Event()
        self._aborted = False
        if store.add(self.key, 1) > ABORTED:  # visible before the first peer looks
            store.set(self.key, b"1")  # alive again in a group made anew on the same store
        store.set(f"{self.key}/waits", b"-")  # one key for good, not one made later
        self._thread = threading.Thread(target=self._run, name=f"xgrad-heartbeat-{rank}")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        published: int | None = None
        while not self._stop.wait(self.interval):
            try:
                self._store.add(self.key, 1)
                waiting = _waiting[0]
                if waiting != published:
                    value = "-" if waiting is None else str(waiting)
                    self._store.set(f"{self.key}/waits", value.encode())
                    published = waiting
            except Exception:  # the store is gone (shutdown): nothing left to tell
                return
        if self._aborted:
            try:
                self._store.add(self.key, ABORTED)
            except Exception:  # the store is gone: the peers see the beats stop instead
                return

    def stop(self, wait: float = 0.0, *, aborted: bool = False) -> None:
        """Stop beating; wait up to ``wait`` seconds for the thread to end. ``aborted``: the
        process aborts the group, and the thread's last write says so (:data:`ABORTED`).

        Waiting matters at interpreter exit: a daemon thread still inside a store call
        when the interpreter finalizes can abort the process.
        """
        self._aborted = self._aborted or aborted
        self._stop.set()
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Liveness:
    """Tracks the heartbeats of ``ranks`` and names those whose counter stopped moving.

    Args:
        store, prefix: where the :class:`Heartbeat` threads write (``prefix/<rank>``).
        ranks: the ranks to watch (those of the step, usually without oneself).
        interval: read the counters at most this often.
        timeout: a rank is stale when its counter did not move for this long.
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        ranks: Iterable[int],
        *,
        interval: float | None = None,
        timeout: float | None = None,
    ) -> None:
        self.prefix = prefix
        self.ranks = tuple(ranks)
        self.interval = check_seconds(
            "heartbeat_interval",
            default_seconds("heartbeat_interval") if interval is None else interval,
        )
        self.timeout = check_seconds(
            "heartbeat_timeout",
            default_seconds("heartbeat_timeout") if timeout is None else timeout,
        )
        self._store = store
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_read = -math.inf

    def read(self, *, force: bool = False) -> None:
        """Read the counters (one store round trip per rank), unless read very recently."""
        now = time.monotonic()
        if not force and now - self._last_read < self.interval:
            return
        self._last_read = now
        for r in self.ranks:
            key = f"{self.prefix}/{r}"
            value = int(self._store.get(key)) if self._store.check([key]) else 0
            old = self._seen.get(r)
            if old is None or old[0] != value:
                self._seen[r] = (value, now)

    def waits_of(self, rank: int) -> int | None:
        """The rank ``rank`` waits for, as its heartbeat last published (None: none)."""
        key = f"{self.prefix}/{rank}/waits"
        if not self._store.check([key]):
            return None
        value = self._store.get(key).decode()
        return None if value == "-" else int(value)

    def end_of_waits(self, rank: int, me: int) -> int:
        """Following who waits for whom from ``rank``: the first rank that waits for
        nobody, the one a chain of live waiting ranks is late for. ``rank`` itself when
        the waits come back to ``me`` or loop (a deadlock: no rank is late)."""
        seen = {me, rank}
        at = rank
        while (nxt := self.waits_of(at)) is not None and nxt != COLLECTIVE:
            if nxt in seen:
                return rank
            seen.add(nxt)
            at = nxt
        return at

    def never_beat(self) -> list[int]:
        """The watched ranks whose counter this reader never saw above 0 (as of the last
        :meth:`read`): not started, or gone before their first beat."""
        return [r for r in self.ranks if self._seen.get(r, (0, 0.0))[0] == 0]

    def aborted(self) -> list[int]:
        """The watched ranks that aborted the group (as of the last :meth:`read`)."""
        return [r for r, (value, _) in sorted(self._seen.items()) if value > ABORTED]

    def lost(self, stale: Sequence[int], seconds: float, waiting: str = "") -> str:
        """What happened to ``stale[0]``, for a failure naming it: it aborted the group,
        never beat, or stopped beating ``seconds`` ago (``waiting``: the wait that saw it)."""
        aborted = self.aborted()
        if stale[0] in aborted:
            rest = [r for r in aborted if r != stale[0]]
            others = f" (so did ranks {rest})" if rest else ""
            return (
                f"aborted the process group{others}{waiting}: it takes no part in the "
                "group's collectives again; make a new group to go on"
            )
        others = f" (also ranks {list(stale[1:])})" if len(stale) > 1 else ""
        if stale[0] in self.never_beat():
            # Not seen alive at all: it may well never have come (a rank that skips the
            # context, or that is still busy before it), not stopped.
            return (
                f"never answered: no heartbeat from it in {seconds:g} s{others}{waiting} (it "
                "has not joined this group's steps yet, or it died before its first beat)"
            )
        return f"stopped answering: no heartbeat for {seconds:g} s{others}{waiting}"

    def idle(self) -> list[int]:
        """The watched ranks that, as their heartbeats last published, wait for nobody:
        those a collective that timed out while the others waited in it is late for."""
        return [r for r in self.ranks if self.waits_of(r) is None]

    def stale(self, older_than: float | None = None, *, include_silent: bool = False) -> list[int]:
        """Ranks whose counter has not moved for ``older_than`` seconds (default: timeout).

        A rank that never beat (it has not joined a step yet) counts only with
        ``include_silent``: late is not dead until a wait's own timeout says so. One that
        aborted the group counts at once.
        """
        now = time.monotonic()
        limit = self.timeout if older_than is None else older_than
        return [
            r
            for r, (value, t) in sorted(self._seen.items())
            if value > ABORTED or (now - t >= limit and (value > 0 or include_silent))
        ]
