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

A record is a snapshot; a diagnosis uses only what cannot change any more: a rank at the
exit (final), a rank in backward pass ``k`` while no rank has finished pass ``k`` (a pass
ends on every rank or none), a receive still waiting for a tensor its sender, stopped so,
has not sent. Counters only grow, so an old record of a receive never proves a deadlock.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from xgrad.failure import FailureChannel, KeyValueStore, RankError, error_for

__all__ = [
    "BALANCE",
    "PROBE_AFTER",
    "PROBE_EVERY",
    "Ledger",
    "ProbingChannel",
    "Record",
    "diagnose",
]

#: seconds a state (a wait in a pass, a receive, the exit) lasts before the rank writes
#: its record and reads the others'; then every PROBE_EVERY seconds while it lasts.
PROBE_AFTER = 0.25
PROBE_EVERY = 0.1


@dataclass(frozen=True)
class Record:
    """One rank's state in a context, as written to the store.

    Attributes:
        state: ``"forward"``, ``"recv"`` (waiting for a tensor), ``"pass"`` (in a backward
            pass) or ``"exit"`` (left the block, waiting for the others).
        passes: backward passes begun (in ``"pass"``: the number of the current one).
        sent, recvd: peer -> tensors sent to / received from it in the context.
        gsent, grecvd: the same, counting only tensors that require grad.
        src: in ``"recv"``, the rank a tensor is awaited from (its index is ``recvd[src]``).
    """

    state: str
    passes: int
    sent: Mapping[int, int] = field(default_factory=dict)
    recvd: Mapping[int, int] = field(default_factory=dict)
    gsent: Mapping[int, int] = field(default_factory=dict)
    grecvd: Mapping[int, int] = field(default_factory=dict)
    src: int = -1

    def to_bytes(self) -> bytes:
        return json.dumps(
            [self.state, self.passes, self.sent, self.recvd, self.gsent, self.grecvd, self.src]
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        state, passes, *counts, src = json.loads(data.decode())
        sent, recvd, gsent, grecvd = ({int(p): int(n) for p, n in c.items()} for c in counts)
        return cls(str(state), int(passes), sent, recvd, gsent, grecvd, int(src))

    def done(self) -> int:
        """Backward passes this rank finished (a rank in a pass finished the ones before)."""
        return self.passes - 1 if self.state == "pass" else self.passes


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _tensors(n: int) -> str:
    return "1 tensor" if n == 1 else f"{n} tensors"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def diagnose(records: Mapping[int, Record], ranks: Sequence[int]) -> tuple[int, str, str] | None:
    """``(origin rank, where, message)`` when the records prove a deadlock; None otherwise.

    ``records`` may lack ranks that wrote none yet (their state is unknown).
    """
    finished = max((r.done() for r in records.values()), default=0)

    def stopped(rank: int) -> bool:  # a rank that does nothing more until the others act
        r = records.get(rank)
        return r is not None and (r.state == "exit" or (r.state == "pass" and r.passes > finished))

    def where(rank: int) -> str:
        r = records[rank]
        return "context exit" if r.state == "exit" else f"backward pass {r.passes}"

    # A tensor awaited that its sender, stopped, has not sent.
    for rank, r in sorted(records.items()):
        if r.state == "recv" and stopped(r.src):
            sender = records[r.src]
            n, want = sender.sent.get(rank, 0), r.recvd.get(r.src, 0)
            if n <= want:
                doing = (
                    "left it" if sender.state == "exit" else f"is in backward pass {sender.passes}"
                )
                return (
                    rank,
                    f"recv from rank {r.src}",
                    f"waits for tensor {want + 1} from rank {r.src}, which sent it {n} in this "
                    f"context and {doing} (a recv with no matching send)",
                )
    cycle = _receive_cycle(records)
    if cycle is not None:
        rank = cycle[0]
        r, chain = records[rank], " -> ".join(map(str, [*cycle, rank]))
        return (
            rank,
            f"recv from rank {r.src}",
            f"waits for tensor {r.recvd.get(r.src, 0) + 1} from rank {r.src}, and ranks "
            f"{chain} each wait in a recv for a tensor the next has not sent (receives that "
            "wait for each other: a recv with no matching send before it)",
        )
    # Tensors sent that their receiver, stopped at the same point, did not receive.
    for p, sender in sorted(records.items()):
        for q, receiver in sorted(records.items()):
            if p == q or not (stopped(p) and stopped(q)) or sender.state != receiver.state:
                continue
            if sender.state == "pass" and sender.passes != receiver.passes:
                continue
            counts = (sender.gsent, receiver.grecvd) if sender.state == "pass" else (
                sender.sent, receiver.recvd,
            )  # fmt: skip
            if counts[0].get(q, 0) != counts[1].get(p, 0):
                before = " before this pass" if sender.state == "pass" else ""
                return (
                    p,
                    where(p),
                    f"sent rank {q} {_tensors(sender.sent.get(q, 0))} in this context{before}, "
                    f"rank {q} received {receiver.recvd.get(p, 0)} (a send with no matching recv)",
                )
    # Backward called a different number of times: every rank is stopped, at the exit or
    # in a pass the others left; the odd ones out are named.
    if len(records) < len(ranks) or not all(stopped(rank) for rank in ranks):
        return None
    groups: dict[int, list[int]] = {}
    for rank in ranks:
        groups.setdefault(records[rank].passes, []).append(rank)
    if len(groups) < 2:
        return None
    count = min(groups, key=lambda c: (len(groups[c]), c != 0, -c))
    origin = groups[count][0]
    others = "; ".join(
        f"{_ranks(rs)} {_times(c)}" for c, rs in sorted(groups.items()) if c != count
    )
    also = f" (also {_ranks(groups[count][1:])})" if len(groups[count]) > 1 else ""
    what = (
        f"left the context after calling backward {_times(count)}"
        if records[origin].state == "exit"
        else f"called backward {_times(count)} in this context"
    )
    return (
        origin,
        where(origin),
        f"{what}{also}, {others} (every rank of the group calls backward the same number of times)",
    )


def _receive_cycle(records: Mapping[int, Record]) -> list[int] | None:
    """Ranks each waiting in a recv for a tensor the next one has not sent, in a cycle
    (from its lowest rank), or None. Each is stuck: its sender cannot send before its own
    recv completes, so the snapshot proves it whatever order the records were written in
    (sends only grow, and a blocked rank sends nothing)."""
    waits: dict[int, int] = {}
    for rank, r in records.items():
        sender = records.get(r.src) if r.state == "recv" else None
        if sender is not None and sender.sent.get(rank, 0) <= r.recvd.get(r.src, 0):
            waits[rank] = r.src
    for start in sorted(waits):
        path, rank = [start], waits[start]
        while rank in waits and rank not in path:
            path.append(rank)
            rank = waits[rank]
        if rank in path:
            cycle = path[path.index(rank) :]
            low = cycle.index(min(cycle))
            return cycle[low:] + cycle[:low]
    return None


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
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: str,
        me: int,
        ranks: Sequence[int],
        release: Callable[[], None],
    ) -> None:
        self.store = store
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
            dict(self.grecvd), self.src,
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

    def check(self, *, prefix: str = "") -> None:
        ledger = self.ledger
        try:
            super().check(prefix=prefix)
        except RankError as exc:
            if ledger is not None and exc.failure.kind == "error":
                ledger.failed()
            raise
        if ledger is not None:
            ledger.probe(self)
            if self._failure is not None:
                raise error_for(self._failure, self.rank, prefix)
