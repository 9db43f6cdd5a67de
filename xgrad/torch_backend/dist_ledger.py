"""What each rank did in a distributed autograd context, read only when a wait lasts: misuse named.

Misuse deadlocks the ranks of a context without failing any of them: a rank leaves the
context without calling ``backward`` (or calls it once more than the others, with
``retain_graph``), a rank sends a tensor nobody receives, or waits for one nobody sends
(or one whose sender waits in a receive first, for a tensor of this rank's: a cycle).
No rank raises; each waits for a message that cannot come until the context's timeout,
and a gloo receive that runs out its timeout closes the group's connections.

So each rank keeps a :class:`Ledger` of the context (tensors sent and received per peer,
backward passes, what it waits for); keeping it costs a few integer updates. Nothing of
it travels on a good pass. Only when a wait has lasted :data:`PROBE_AFTER` seconds (read
where the failure channel is read: every wait of a context does) does the rank write its
record to the group's store and read the others'; records that prove a deadlock
(:func:`diagnose`) are posted as a failure naming the rank that did the odd thing, e.g.
``"Error on rank 1 in backward pass 2: called backward 2 times in this context, ranks 0,
2 once"``, and every rank raises it at once. At the exit, each rank adds its balance of
tensors received minus sent to the barrier's count (:data:`BALANCE`), so the barrier
passes only when every send was received (the same store traffic as a plain barrier: one
add, then reads), and a tensor nobody received is a wait that lasts, then a diagnosis.

The records and their diagnosis are :mod:`.dist_diagnose` (:class:`Record`,
:func:`diagnose`, :func:`step_mismatch`, re-exported here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from xgrad.failure import FailureChannel, KeyValueStore, RankError, error_for
from xgrad.torch_backend.dist_diagnose import Record, diagnose, step_mismatch

__all__ = [
    "BALANCE",
    "PROBE_AFTER",
    "PROBE_EVERY",
    "Ledger",
    "ProbingChannel",
    "Record",
    "diagnose",
    "step_mismatch",
]

#: seconds a state (a wait in a pass, a receive, the exit) lasts before the rank writes
#: its record and reads the others'; then every PROBE_EVERY seconds while it lasts.
PROBE_AFTER = 0.25
PROBE_EVERY = 0.1


#: the exit barrier's count: each rank adds 1 + BALANCE * (tensors received - sent), so
#: it reaches the world size exactly when every rank arrived and every send was received
#: (a partial sum never does: the balance term is a multiple of BALANCE > world size).
BALANCE = 1 << 24


class Ledger:
    """What this rank did in one context, and its probe of the others when a wait lasts.

    Args:
        store: the group's store; prefix: the context's namespace in it.
        me: this rank; ranks: the group's ranks (global).
        release: called once, on whatever thread probes, when a failure is seen while this
            rank is in a pass: answers what peers may wait for from this rank (a peer stuck
            in a pass on a thread-free receive from this rank reads no channel).
        step: the context's step label (``repr`` text; None: it has none), in the record.
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        me: int,
        ranks: Sequence[int],
        release: Callable[[], None],
        step: str | None = None,
    ) -> None:
        self.store = store
        self.step = step
        self.prefix = prefix
        self.me = me
        self.ranks = list(ranks)
        self.sent: dict[int, int] = {}
        self.recvd: dict[int, int] = {}
        self.gsent: dict[int, int] = {}
        self.grecvd: dict[int, int] = {}
        self.passes = 0
        self.state = "forward"
        self.src = -1
        self._since = time.monotonic()
        self._written = False
        # Whether this rank's record is in the store (deleted after the context).
        self.stored = False
        self._next = 0.0
        self._release = release
        self._released = False
        self._lock = threading.Lock()
        self.records: dict[int, Record] = {}

    def enter(self, state: str, src: int = -1) -> None:
        """This rank now does ``state`` (a record is written only if it lasts)."""
        self.state, self.src = state, src
        self._since = time.monotonic()
        self._written = False

    def sent_to(self, peer: int, requires_grad: bool) -> None:
        self.sent[peer] = self.sent.get(peer, 0) + 1
        if requires_grad:
            self.gsent[peer] = self.gsent.get(peer, 0) + 1

    def received_from(self, peer: int, requires_grad: bool) -> None:
        self.recvd[peer] = self.recvd.get(peer, 0) + 1
        if requires_grad:
            self.grecvd[peer] = self.grecvd.get(peer, 0) + 1

    def record(self) -> Record:
        return Record(
            self.state, self.passes, dict(self.sent), dict(self.recvd), dict(self.gsent),
            dict(self.grecvd), self.src, self.step,
        )  # fmt: skip

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/ledger/{rank}"

    def written(self) -> list[str]:
        """This rank's record's key, if a probe wrote it (for deletion once nobody reads it)."""
        return [self._key(self.me)] if self.stored else []

    def exit_amount(self) -> int:
        """Enter the exit; what this rank adds to the exit barrier's count (see BALANCE)."""
        self.enter("exit")
        return 1 + BALANCE * (sum(self.recvd.values()) - sum(self.sent.values()))

    def probe(self, channel: FailureChannel) -> None:
        """If the current state lasted: write this rank's record, read the others', post a
        proven deadlock (and answer what peers may wait for, in a pass)."""
        now = time.monotonic()
        if now - self._since < PROBE_AFTER or now < self._next or self.state == "forward":
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._next = now + PROBE_EVERY
            if not self._written:
                self.store.set(self._key(self.me), self.record().to_bytes())
                self._written = self.stored = True
            for rank in self.ranks:
                if rank != self.me and self.store.check([self._key(rank)]):
                    self.records[rank] = Record.from_bytes(self.store.get(self._key(rank)))
            self.records[self.me] = self.record()
            found = diagnose(self.records, self.ranks)
            if found is not None:
                origin, where, message = found
                channel.post(where, message, rank=origin)
                self._answer()
        except Exception:  # the store failed: the wait's own timeout still bounds it
            pass
        finally:
            self._lock.release()

    def failed(self) -> None:
        """A live rank's failure was seen: if this rank has waited in a pass a while (where
        a peer may wait on it, blocked), answer what peers may wait for."""
        if self.state == "pass" and time.monotonic() - self._since >= PROBE_AFTER:
            with self._lock:
                self._answer()

    def _answer(self) -> None:
        if self.state == "pass" and not self._released:
            self._released = True
            self._release()


class ProbingChannel(FailureChannel):
    """A context's failure channel: each check also runs the ledger's probe (when a wait lasts)."""

    def __init__(self, base: FailureChannel) -> None:
        super().__init__(base.store, base.prefix, base.rank, base.liveness)
        self.ledger: Ledger | None = None

    def check(self, *, prefix: str = "", posted: bool = True) -> None:
        ledger = self.ledger
        try:
            super().check(prefix=prefix, posted=posted)
        except RankError as exc:
            if ledger is not None and exc.failure.kind == "error":
                ledger.failed()
            raise
        if ledger is not None:
            ledger.probe(self)
            if self._failure is not None:
                raise error_for(self._failure, self.rank, prefix)
