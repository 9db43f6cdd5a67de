"""What the records of a context's ranks prove: a deadlock, and the rank that caused it.

Each rank of a distributed autograd context writes a :class:`Record` of what it did
(tensors sent and received per peer, backward passes, what it waits for) to the group's
store once a wait has lasted (:mod:`.dist_ledger`, which keeps the counts and re-exports
these names); :func:`diagnose` reads the records of every rank that wrote one and names
the rank that did the odd thing: ranks in different steps (contexts opened with
different ``step`` labels, paired up because a rank skipped one), a receive with no
matching send, receives that wait for each other, a send nobody receives, or backward
called a different number of times.
Kept apart from the ledger because it is pure: records in, a diagnosis out, no store and
no clock, so it is tested on records alone.

A record is a snapshot; a diagnosis uses only what cannot change any more: a rank at the
exit (final), a rank in backward pass ``k`` while no rank has finished pass ``k`` (a pass
ends on every rank or none), a receive still waiting for a tensor its sender, stopped so,
has not sent. Counters only grow, so an old record of a receive never proves a deadlock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Record", "diagnose", "step_mismatch"]


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
        step: the context's step label as written (``repr``; None: it has none).
    """

    state: str
    passes: int
    sent: Mapping[int, int] = field(default_factory=dict)
    recvd: Mapping[int, int] = field(default_factory=dict)
    gsent: Mapping[int, int] = field(default_factory=dict)
    grecvd: Mapping[int, int] = field(default_factory=dict)
    src: int = -1
    step: str | None = None

    def to_bytes(self) -> bytes:
        counts = [self.sent, self.recvd, self.gsent, self.grecvd]
        return json.dumps([self.state, self.passes, *counts, self.src, self.step]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        state, passes, *counts, src, step = json.loads(data.decode())
        sent, recvd, gsent, grecvd = ({int(p): int(n) for p, n in c.items()} for c in counts)
        step = None if step is None else str(step)
        return cls(str(state), int(passes), sent, recvd, gsent, grecvd, int(src), step)

    def done(self) -> int:
        """Backward passes this rank finished (a rank in a pass finished the ones before)."""
        return self.passes - 1 if self.state == "pass" else self.passes


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _tensors(n: int) -> str:
    return "1 tensor" if n == 1 else f"{n} tensors"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _in_step(step: str | None) -> str:
    return "a context without a step" if step is None else f"step {step}"


def step_mismatch(steps: Mapping[int, str | None], odd: int) -> str:
    """The message for ranks whose paired contexts have different step labels: ``steps``
    is rank -> its context's label (``repr`` text; None: none), ``odd`` the rank named
    first (``"rank 1 is in step 5, rank 0 in step 4 ..."``)."""
    groups: dict[str | None, list[int]] = {}
    for rank, step in sorted(steps.items()):
        groups.setdefault(step, []).append(rank)
    mine = steps[odd]
    also = [r for r in groups[mine] if r != odd]
    with_ = f" (with {_ranks(also)})" if also else ""
    others = ", ".join(f"{_ranks(rs)} in {_in_step(s)}" for s, rs in groups.items() if s != mine)
    return (
        f"step mismatch: rank {odd}{with_} is in {_in_step(mine)}, {others} (contexts pair "
        "up in the order each rank opens them on a group: a rank skipped a context or opened "
        "one more; this context fails on every rank, and the next one whose steps match works)"
    )


def diagnose(records: Mapping[int, Record], ranks: Sequence[int]) -> tuple[int, str, str] | None:
    """``(origin rank, where, message)`` when the records prove a deadlock (or ranks in
    different steps, which no later record changes); None otherwise.

    ``records`` may lack ranks that wrote none yet (their state is unknown).
    """
    steps = {rank: r.step for rank, r in records.items()}
    if len(set(steps.values())) > 1:
        alike: dict[str | None, int] = {}
        for step in steps.values():
            alike[step] = alike.get(step, 0) + 1
        odd = min(sorted(steps), key=lambda rank: alike[steps[rank]])  # the fewest's lowest
        r = records[odd]
        at = {"recv": f"recv from rank {r.src}", "pass": f"backward pass {r.passes}"}
        return odd, at.get(r.state, "context exit"), step_mismatch(steps, odd)
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
