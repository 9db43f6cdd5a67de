"""What a rank's step wire needs of its schedule, worked out once per runtime.

Every step used to list the rank's actions, its receives, its edges and its sends per
edge again before posting its first receive: work on the step's critical path (stage 0
computes nothing until its wire is made), for data that depends on the schedule and the
rank only. :class:`WirePlan` holds it, frozen, for every step's
:class:`~xgrad.torch_backend.pipeline_comm.StepWire`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xgrad.pipeline import Action, Kind, Schedule, expand
from xgrad.torch_backend.pipeline_lanes import lane_of

__all__ = ["Edge", "WirePlan"]

Edge = tuple[int, int, int]  # (source stage, consumer stage, 0 forward / 1 backward)


@dataclass(frozen=True)
class WirePlan:
    """One rank's messages in every step of ``schedule``.

    Attributes:
        actions: the rank's actions, expanded (a step runs them in this order).
        recvs: ``(index, action)`` of its receives, in posting order.
        sends: per edge on which it sends, how many messages a step sends there.
        in_edges: ``(source, stage)`` pairs whose messages come from another rank.
        out_edges: ``(stage, consumer)`` pairs whose messages go to another rank.
        peers: per edge of this rank (either direction), the schedule rank at its other end.
        upstream: the edges whose messages go from a higher rank to a lower one (lane 1
            when there are two lanes, see ``pipeline_lanes``).
    """

    actions: tuple[Action, ...]
    recvs: tuple[tuple[int, Action], ...]
    sends: dict[Edge, int]
    in_edges: tuple[tuple[int, int], ...]
    out_edges: tuple[tuple[int, int], ...]
    peers: dict[Edge, int]
    upstream: frozenset[Edge]

    @classmethod
    def of(cls, schedule: Schedule, rank: int) -> WirePlan:
        """The plan of ``rank`` in ``schedule`` (validated, with comms)."""
        place = schedule.placement
        actions = tuple(expand(schedule.actions[rank]))
        recvs = tuple((i, a) for i, a in enumerate(actions) if a.kind in (Kind.RECV_F, Kind.RECV_B))
        sends: dict[Edge, int] = {}
        for a in actions:
            if a.kind is Kind.SEND_F:
                edges = [(a.stage, t, 0) for t in schedule.consumers(a.stage)]
            elif a.kind is Kind.SEND_B:
                edges = [(s, a.stage, 1) for s in schedule.sources(a.stage)]
            else:
                continue
            for s, t, d in edges:
                if place[s] != place[t]:
                    sends[(s, t, d)] = sends.get((s, t, d), 0) + 1
        mine = schedule.stages_of(rank)
        in_edges = tuple((s, t) for t in mine for s in schedule.sources(t) if place[s] != rank)
        out_edges = tuple((s, t) for s in mine for t in schedule.consumers(s) if place[t] != rank)
        peers: dict[Edge, int] = {}
        upstream = set()
        for s, t in in_edges + out_edges:
            for d in (0, 1):
                peer = place[t] if place[s] == rank else place[s]
                peers[(s, t, d)] = peer
                sender, receiver = (place[s], place[t]) if d == 0 else (place[t], place[s])
                if lane_of(sender, receiver, 2):
                    upstream.add((s, t, d))
        return cls(actions, recvs, sends, in_edges, out_edges, peers, frozenset(upstream))
