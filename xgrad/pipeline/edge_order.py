"""The order of each edge's messages: a receiver takes them in the order they were sent.

A point-to-point runtime matches the messages of one edge (source stage, consumer stage,
direction) in the order they come: gloo pairs the n-th send on a tag with the n-th receive
posted on it, and xgrad's torch runtime gives every edge and direction its own tag, posts
an edge's receives in the order of the rank's receive actions and takes each message, the
next in line, at the pass that uses it. A schedule whose two ranks order an edge's
microbatches differently therefore runs until the first message that is not the one
expected, and fails there, mid-step; :func:`first_misordered` finds it up front.

Messages of different edges, or of the two directions of one edge, are not ordered
against each other: only each edge-direction's own sequence has to agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from xgrad.pipeline.actions import Kind, expand
from xgrad.pipeline.schedule import Schedule

__all__ = ["Misordered", "first_misordered"]

# microbatches shown either side of the first difference in an error message
_SHOWN = 3


@dataclass(frozen=True)
class Misordered:
    """The first edge whose messages the receiver expects in another order than sent.

    Attributes:
        rank: the receiving rank; ``step`` the index (expanded actions) of its action that
            would take the wrong message.
        reason: the edge, its kind and the two orders, as a sentence.
    """

    rank: int
    step: int
    reason: str


def _sequences(schedule: Schedule) -> dict[tuple[int, int, int, str], list[tuple[int, int]]]:
    """Per (source stage, consumer stage, direction, role): ``(microbatch, step)`` in the
    order of the rank that plays ``role`` there ("send": the sender's sends, "post" and
    "use": the receiver's receives and the passes that take the message). Without explicit
    comms a send is the pass that makes the message and no receive is posted apart."""
    place, comms = schedule.placement, schedule.has_comms
    seqs: dict[tuple[int, int, int, str], list[tuple[int, int]]] = {}

    def add(s: int, t: int, d: int, role: str, mb: int, step: int) -> None:
        if place[s] != place[t]:
            seqs.setdefault((s, t, d, role), []).append((mb, step))

    for acts in schedule.actions:
        for i, a in enumerate(expand(acts)):
            k, st, mb = a.kind, a.stage, a.microbatch
            backward = k in (Kind.BACKWARD, Kind.BACKWARD_INPUT)
            if k is (Kind.SEND_F if comms else Kind.FORWARD):
                for t in schedule.consumers(st):
                    add(st, t, 0, "send", mb, i)
            if k is Kind.SEND_B or (backward and not comms):
                for s in schedule.sources(st):
                    add(s, st, 1, "send", mb, i)
            if k is Kind.RECV_F or k is Kind.FORWARD:
                role = "post" if k is Kind.RECV_F else "use"
                for s in schedule.sources(st):
                    add(s, st, 0, role, mb, i)
            if k is Kind.RECV_B or backward:
                role = "post" if k is Kind.RECV_B else "use"
                for t in schedule.consumers(st):
                    add(st, t, 1, role, mb, i)
    return seqs


def _shown(mbs: list[int], at: int) -> str:
    """``mbs`` around index ``at`` (the first difference), elided beyond a few."""
    lo, hi = max(0, at - _SHOWN), min(len(mbs), at + _SHOWN + 1)
    text = ", ".join(str(mb) for mb in mbs[lo:hi])
    return ("..., " if lo else "") + text + (", ..." if hi < len(mbs) else "")


def first_misordered(schedule: Schedule) -> Misordered | None:
    """The first cross-rank edge whose receiver expects its messages in another order than
    its sender sends them (receives posted, or passes taking them), or None.

    Expects a schedule whose contents were checked (every pass and comm once, on its rank).
    """
    place = schedule.placement
    seqs = _sequences(schedule)
    for (s, t, d, role), taken in sorted(seqs.items()):
        if role == "send":
            continue
        sent = seqs.get((s, t, d, "send"), [])
        got, want = [mb for mb, _ in taken], [mb for mb, _ in sent]
        if got == want:
            continue
        at = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        at = min(len(got), len(want)) if at is None else at
        sender, receiver = (place[s], place[t]) if d == 0 else (place[t], place[s])
        what = "activations" if d == 0 else "gradients"
        frm, to = (s, t) if d == 0 else (t, s)
        if role == "post":
            takes = f"posts its receives ({(Kind.RECV_F if d == 0 else Kind.RECV_B).value}) for"
        else:
            takes = f"expects, at its {'forward' if d == 0 else 'backward'} passes,"
        step = taken[at][1] if at < len(taken) else len(list(expand(schedule.actions[receiver])))
        reason = (
            f"{what} from stage {frm} (rank {sender}) to stage {to} (rank {receiver}) are "
            f"out of order: rank {sender} sends microbatches {_shown(want, at)}; rank "
            f"{receiver} {takes} {_shown(got, at)} (a runtime takes each edge's messages "
            "first in, first out)"
        )
        return Misordered(receiver, step, reason)
    return None
