"""The order of each edge's messages: receives are posted in the order the sender sends.

A point-to-point runtime pairs the messages of one edge (source stage, consumer stage,
direction) with its receives in the order both are posted: gloo pairs the n-th send on a
tag with the n-th receive posted on it, and xgrad's torch runtime gives every edge and
direction its own tag and posts an edge's receives in the order of the rank's receive
actions. A schedule with comms whose receive actions list an edge's microbatches in
another order than the sender's sends would put one microbatch's data in another's
buffers; :func:`first_misordered` finds it up front.

The passes that use the messages may take them in any order: torch's comm lowering
(``_add_send_recv``, and :func:`~xgrad.pipeline.insert_comms`, which matches it) places
each receive when its send is placed, so a compute-only schedule whose two ranks order an
edge's microbatches differently (rank 0 sends microbatch 1 first, rank 1 runs its forward
of 0 first) lowers to receives in the sender's order, and the runtime takes the message
of the microbatch a pass needs, whichever came first (each header names its microbatch).
Whether such an order can finish at all is the lock-step run's question
(:mod:`xgrad.pipeline.lockstep`), which refuses an order that deadlocks.

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
    """The first edge whose receives are posted in another order than its messages sent.

    Attributes:
        rank: the receiving rank; ``step`` the index (expanded actions) of its receive
            that would be paired with another microbatch's message.
        reason: the edge, its kind and the two orders, as a sentence.
    """

    rank: int
    step: int
    reason: str


_Edge = tuple[int, int, int]  # (source stage, consumer stage, 0 forward / 1 backward)


def _sequences(
    schedule: Schedule,
) -> tuple[dict[_Edge, list[tuple[int, int]]], dict[_Edge, list[tuple[int, int]]]]:
    """Per cross-rank edge: ``(microbatch, step)`` of its sends in the sender's order,
    and of its receives in the receiver's order (a schedule with comms)."""
    place = schedule.placement
    sends: dict[_Edge, list[tuple[int, int]]] = {}
    recvs: dict[_Edge, list[tuple[int, int]]] = {}

    def add(seqs: dict[_Edge, list[tuple[int, int]]], edge: _Edge, mb: int, step: int) -> None:
        if place[edge[0]] != place[edge[1]]:
            seqs.setdefault(edge, []).append((mb, step))

    for acts in schedule.actions:
        for i, a in enumerate(expand(acts)):
            k, st, mb = a.kind, a.stage, a.microbatch
            if k is Kind.SEND_F or k is Kind.RECV_B:
                for t in schedule.consumers(st):
                    add(sends if k is Kind.SEND_F else recvs, (st, t, int(k is Kind.RECV_B)), mb, i)
            elif k is Kind.RECV_F or k is Kind.SEND_B:
                for s in schedule.sources(st):
                    add(recvs if k is Kind.RECV_F else sends, (s, st, int(k is Kind.SEND_B)), mb, i)
    return sends, recvs


def _shown(mbs: list[int], at: int) -> str:
    """``mbs`` around index ``at`` (the first difference), elided beyond a few."""
    lo, hi = max(0, at - _SHOWN), min(len(mbs), at + _SHOWN + 1)
    text = ", ".join(str(mb) for mb in mbs[lo:hi])
    return ("..., " if lo else "") + text + (", ..." if hi < len(mbs) else "")


def first_misordered(schedule: Schedule) -> Misordered | None:
    """The first cross-rank edge whose receiver posts its receives in another order than
    its sender sends the messages, or None (always None without explicit comms: lowering
    places the receives in the sender's order).

    Expects a schedule whose contents were checked (every pass and comm once, on its rank).
    """
    if not schedule.has_comms:
        return None
    place = schedule.placement
    sends, recvs = _sequences(schedule)
    for (s, t, d), taken in sorted(recvs.items()):
        sent = sends.get((s, t, d), [])
        got, want = [mb for mb, _ in taken], [mb for mb, _ in sent]
        if got == want:
            continue
        at = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        at = min(len(got), len(want)) if at is None else at
        sender, receiver = (place[s], place[t]) if d == 0 else (place[t], place[s])
        what = "activations" if d == 0 else "gradients"
        frm, to = (s, t) if d == 0 else (t, s)
        recv = (Kind.RECV_F if d == 0 else Kind.RECV_B).value
        step = taken[at][1] if at < len(taken) else len(list(expand(schedule.actions[receiver])))
        reason = (
            f"{what} from stage {frm} (rank {sender}) to stage {to} (rank {receiver}) are "
            f"received out of order: rank {sender} sends microbatches {_shown(want, at)}; "
            f"rank {receiver} posts its receives ({recv}) for {_shown(got, at)} (a runtime "
            "pairs an edge's n-th message with its n-th receive: list the receives in the "
            "order of the sends, as torch's and xgrad's comm lowering do; the passes may "
            "use them in any order)"
        )
        return Misordered(receiver, step, reason)
    return None
