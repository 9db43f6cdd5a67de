"""Schedules with several stages per rank: interleaved 1F1B and zero-bubble, looped BFS,
ZB-V and DualPipeV, each giving the per-rank order of ``torch.distributed.pipelining``'s
schedule of the same name for the same (p, m, chunks).

Index letters as in :mod:`xgrad.pipeline.generators`: p ranks, m microbatches, v chunks
(virtual stages) per rank. Loop placement puts virtual stage s on rank s mod p; V placement
(ZB-V, DualPipeV) puts stages 0..p-1 on ranks 0..p-1 and stages p..2p-1 back on ranks p-1..0,
so rank 0 holds the first and the last stage.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.schedule import Schedule

__all__ = [
    "dualpipev",
    "interleaved_1f1b",
    "interleaved_zb",
    "looped_bfs",
    "v_placement",
    "zbv",
]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum`` (any integer type, numpy's too, not a
    bool); a ``ValueError`` naming ``name`` and the value otherwise."""
    if not isinstance(value, bool):
        try:
            count = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if count >= minimum:
                return count
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _rounds(p: int, m: int, what: str) -> int:
    """Microbatches per round: torch's flexible interleaving runs max(1, m // p) rounds and
    needs m to split evenly into them (m = 10 for p = 4 is 2 rounds of 5; m < p is one)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"{what} needs num_microbatches a multiple of its {rounds} rounds "
            f"(max(1, num_microbatches // num_stages) with num_stages={p}), got {m}"
        )
    return m // rounds


def _looped_1f1b(p: int, m: int, v: int, r: int, *, zero_bubble: bool) -> list[Action]:
    """Rank r's order in Megatron's interleaved 1F1B, or its ZB-1P variant.

    Warm-up runs (v-1)·k + f·(p-1-r) chunk forwards (k microbatches per round, f = 2 for 1F1B
    and 1 for zero-bubble); then each step is one forward and one backward, forwards walking
    the chunks upward in rounds of k and backwards downward; the cool-down runs the remaining
    backwards. With ``zero_bubble`` the backward is split: I in its place, and W of the
    oldest I once rank r has run r steps of I (so later ranks defer more weight passes into
    their drain), the rest of W at the end.
    """
    per_round = _rounds(p, m, "interleaved_zb" if zero_bubble else "interleaved_1f1b")
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), total)
    backward_kind = I if zero_bubble else B

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * p + r

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + r

    counts: dict[tuple[int, Kind], int] = {}

    def next_action(stage: int, kind: Kind) -> Action:
        mb = counts.get((stage, kind), 0)
        counts[stage, kind] = mb + 1
        return Action(stage, kind, mb)

    acts: list[Action] = []
    backward_steps: list[int] = []
    weights = 0
    for step in range(total + warmup):
        if step < total:
            acts.append(next_action(forward_stage(step), F))
        if step >= warmup:
            acts.append(next_action(backward_stage(step), backward_kind))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= r:
                acts.append(next_action(backward_stage(backward_steps[weights]), W))
                weights += 1
    while zero_bubble and weights < len(backward_steps):
        acts.append(next_action(backward_stage(backward_steps[weights]), W))
        weights += 1
    return acts


def _loop_placement(p: int, v: int) -> tuple[int, ...]:
    return tuple(s % p for s in range(p * v))


# Interleaved 1F1B (Megatron-LM): rank r holds chunks r, r+p, ..., r+(v-1)p; microbatches go
# through the chunks in rounds. With chunk costs 1/v of a whole stage, the bubble time is 1/v
# of 1F1B's. In list order, p = 2, m = 4, v = 2 (rank 0 runs stages 0 and 2):
#
#   rank 0  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
#   rank 1  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B with v = ``chunks`` virtual stages per rank, p = ``num_stages`` ranks.

    Any m that splits evenly into max(1, m // p) rounds (m = 10 for p = 4; m < p), as torch's
    ``ScheduleInterleaved1F1B``. Bubble fraction (p-1)/(v·m+p-1) for m a multiple of p.
    """
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    ranks = tuple(tuple(_looped_1f1b(p, m, v, r, zero_bubble=False)) for r in range(p))
    return Schedule(ranks, _loop_placement(p, v), m, f"interleaved_1f1b(v={v})")


def interleaved_zb(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved zero-bubble (ZB-1P over v chunks per rank), torch's
    ``ScheduleInterleavedZeroBubble``: interleaved 1F1B's order with the backward split into I
    and W, a shorter warm-up, and rank r deferring its weight passes by r steps."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    ranks = tuple(tuple(_looped_1f1b(p, m, v, r, zero_bubble=True)) for r in range(p))
    return Schedule(ranks, _loop_placement(p, v), m, f"interleaved_zb(v={v})")


def looped_bfs(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Breadth-first looping (torch's ``ScheduleLoopedBFS``): each rank runs every microbatch
    through its lowest chunk, then the next; backwards run the chunks from the top down, the
    microbatches in reverse. Holds all m microbatches of every chunk, like GPipe."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    ranks = []
    for r in range(p):
        stages = range(r, p * v, p)
        acts = [Action(s, F, mb) for s in stages for mb in range(m)]
        acts += [Action(s, B, mb) for s in reversed(stages) for mb in reversed(range(m))]
        ranks.append(tuple(acts))
    return Schedule(tuple(ranks), _loop_placement(p, v), m, f"looped_bfs(v={v})")


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Stage -> rank for the V shape: 0, 1, ..., p-1, p-1, ..., 1, 0."""
    p = check_count("num_ranks", num_ranks)
    return tuple(range(p)) + tuple(reversed(range(p)))


class _Counter:
    """Next microbatch per (stage, kind), as a rank's list is built."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, Kind], int] = {}

    def peek(self, stage: int, kind: Kind) -> int:
        return self.counts.get((stage, kind), 0)

    def take(self, stage: int, kind: Kind) -> Action:
        mb = self.peek(stage, kind)
        self.counts[stage, kind] = mb + 1
        return Action(stage, kind, mb)

    def repeat(
        self, times: int, steps: tuple[tuple[int, Kind], ...], below: int, acts: list[Action]
    ) -> None:
        """``times`` rounds of ``steps`` (distinct (stage, kind) pairs), each step taking
        its next microbatch, appending to ``acts`` those below ``below``: the rounds past
        that cut are counted, not run, so a rank built for more microbatches than it keeps
        costs what it keeps."""
        starts = [self.peek(stage, kind) for stage, kind in steps]
        for i in range(min(times, max(below - mb for mb in starts))):
            acts += [
                Action(s, k, mb + i)
                for (s, k), mb in zip(steps, starts, strict=True)
                if mb + i < below
            ]
        for (stage, kind), mb in zip(steps, starts, strict=True):
            self.counts[stage, kind] = mb + times


def _zbv_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r of ZB-V: its order for max(m, 2p-1) microbatches, cut to the first m.

    Only the cut is listed (its phases as rounds of :meth:`_Counter.repeat`): building the
    whole order for m = 1 made ZB-V quadratic in p (11 s at p = 1000).
    """
    n = max(2 * p - 1, m)
    low, high = r, 2 * p - 1 - r  # the rank's two stages: down the V and back up
    c = _Counter()
    acts: list[Action] = []
    c.repeat(2 * (p - r) - 1, ((low, F),), m, acts)
    c.repeat(r, ((high, F), (low, F)), m, acts)
    c.repeat(p - r, ((high, F), (high, I), (high, W)), m, acts)
    # The steady state: F (while the low stage has forwards left), I, W of the low stage,
    # then of the high one, until both stages ran n forwards.
    with_forward = max(0, n - c.peek(low, F))
    rounds = max(with_forward, n - c.peek(high, F))
    steady = ((low, I), (low, W), (high, F), (high, I), (high, W))
    c.repeat(with_forward, ((low, F), *steady), m, acts)
    c.repeat(rounds - with_forward, steady, m, acts)
    c.repeat(r, ((low, I), (high, I)), m, acts)
    c.repeat(p - r, ((low, I), (low, W)), m, acts)
    for stage in (high, low):
        c.repeat(c.peek(stage, I) - c.peek(stage, W), ((stage, W),), m, acts)
    return acts


def zbv(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """ZB-V (torch's ``ScheduleZBVZeroBubble``): two stages per rank in V placement (rank 0
    holds stages 0 and 2p-1), backward split into I and W; zero bubble when F = I = W."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    if chunks != 2:
        raise ValueError(f"zbv places exactly 2 stages per rank (chunks=2), got chunks={chunks!r}")
    ranks = tuple(tuple(_zbv_rank(p, m, r)) for r in range(p))
    return Schedule(ranks, v_placement(p), m, "zbv")


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r of DualPipeV: DeepSeek's schedule with overlapped forward/backward pairs."""
    low, high = r, 2 * p - 1 - r
    c = _Counter()
    acts: list[Action] = []
    weights: list[Action] = []  # W passes owed, oldest first

    def add(stage: int, kind: Kind) -> Action:
        if kind is B:
            # A full backward counts as an I and a W of its microbatch.
            mb = c.peek(stage, I)
            c.take(stage, I)
            c.take(stage, W)
            return Action(stage, B, mb)
        a = c.take(stage, kind)
        if kind is I:
            weights.append(Action(stage, W, a.microbatch))
        return a

    def single(stage: int, kind: Kind) -> None:
        acts.append(add(stage, kind))

    def pair(forward_stage: int, backward_stage: int) -> None:
        f = add(forward_stage, F)
        acts.append(Action.overlap(f, add(backward_stage, B)))

    def owed_weight() -> None:
        if weights:
            w = weights.pop(0)
            c.take(w.stage, W)
            acts.append(w)

    for _ in range(2 * (p - r - 1)):
        single(low, F)
    for _ in range(r + 1):
        single(low, F)
        single(high, F)
    for _ in range(p - r - 1):
        single(high, I)
        owed_weight()
        single(high, F)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            single(low, F)  # not overlapped, to shorten the bubble
            single(high, B)
        else:
            pair(low, high)
        pair(high, low)
    for _ in range(p - r - 1):
        single(high, B)
        pair(high, low)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        single(high, I if split else B)
        if i == steps // 2 and r % 2 == 0:
            split = True
        single(low, I if split else B)
    for _ in range(p - r - 1):
        owed_weight()
        single(low, I if split else B)
    for _ in range(r + 1):
        owed_weight()
    return acts


def dualpipev(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """DualPipeV (torch's ``ScheduleDualPipeV``, after DeepSeek's DualPipe): V placement, the
    steady state issuing a forward of one stage and a backward of the other as one
    overlapped pair (``OVERLAP_F_B``), the drain split into I and W. Needs m >= 2p."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    if chunks != 2:
        raise ValueError(
            f"dualpipev places exactly 2 stages per rank (chunks=2), got chunks={chunks!r}"
        )
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs num_microbatches >= the {2 * p} stages (2 per rank), got {m}"
        )
    ranks = tuple(tuple(_dualpipev_rank(p, m, r)) for r in range(p))
    return Schedule(ranks, v_placement(p), m, "dualpipev")


#: name -> generator taking (num_stages, num_microbatches, chunks).
MULTISTAGE: dict[str, Callable[[int, int, int], Schedule]] = {
    "interleaved_1f1b": interleaved_1f1b,
    "interleaved_zb": interleaved_zb,
    "looped_bfs": looped_bfs,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
