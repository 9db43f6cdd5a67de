"""Schedule generators: GPipe, 1F1B, ZB-H1 and ZB-H2 (one stage per rank), and the registry.

Index letters, used throughout: p ranks (pipeline stages of the model, one per rank), m
microbatches, v chunks (virtual stages) per rank. Each generator returns a compute-only
:class:`~xgrad.pipeline.Schedule`; :func:`~xgrad.pipeline.insert_comms` adds the sends and
receives. ZB-H2's order, and :func:`~xgrad.pipeline.from_invocations` for any placement,
come from the list scheduler (:mod:`xgrad.pipeline.list_scheduler`). The drawings show
p = 4, m = 8 with the equal costs of :data:`~xgrad.pipeline.DEFAULT_COSTS` (F = I = W = 1,
B = 2), as simulated: each unit of time is two characters, the pass and its microbatch (a
B, two units, shows twice; ``..`` is idle).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.list_scheduler import from_invocations as from_invocations
from xgrad.pipeline.list_scheduler import list_schedule
from xgrad.pipeline.multistage import MULTISTAGE, check_count, interleaved_1f1b
from xgrad.pipeline.schedule import Schedule

__all__ = [
    "MAX_PAIRS",
    "SCHEDULES",
    "check_size",
    "from_invocations",
    "gpipe",
    "interleaved_1f1b",
    "make",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def _chain(p: int) -> tuple[int, ...]:
    return tuple(range(p))


# GPipe (fill-drain): every forward, then every backward; holds all m microbatches.
#
#   rank 0  F0F1F2F3F4F5F6F7..................B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7
#   rank 1  ..F0F1F2F3F4F5F6F7............B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7
#   rank 2  ....F0F1F2F3F4F5F6F7......B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7
#   rank 3  ......F0F1F2F3F4F5F6F7B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all m forwards, then all m backwards (bubble (p-1)/(m+p-1), holds m)."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    actions = tuple(
        tuple(Action(r, F, i) for i in range(m)) + tuple(Action(r, B, i) for i in range(m))
        for r in range(p)
    )
    return Schedule(actions, _chain(p), m, "gpipe")


# 1F1B: rank r runs p-1-r warm-up forwards, then alternates one forward and one backward,
# then drains; holds at most p - r microbatches, with GPipe's bubble.
#
#   rank 0  F0F1F2F3............B0B0F4B1B1F5B2B2F6B3B3F7B4B4..B5B5..B6B6..B7B7
#   rank 1  ..F0F1F2........B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5..B6B6..B7B7
#   rank 2  ....F0F1....B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6..B7B7
#   rank 3  ......F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): bubble (p-1)/(m+p-1), at most p microbatches held."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(r, F, warmup + i), Action(r, B, i)]
        acts += [Action(r, B, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Schedule(tuple(ranks), _chain(p), m, "1f1b")


# ZB-H1 (zero-bubble, 1F1B's memory): 1F1B with backward split into I (input gradient, on the
# critical path) and W (weight gradient, free to move). Rank r defers its weight passes by r
# steps, so the later ranks fill their drain with W; every rank holds p microbatches. Bubble
# p-1 units against 1F1B's 3(p-1): a third.
#
#   rank 0  F0F1F2F3......I0W0F4I1W1F5I2W2F6I3W3F7I4W4I5W5I6W6I7W7
#   rank 1  ..F0F1F2....I0F3I1W0F4I2W1F5I3W2F6I4W3F7I5W4I6W5I7W6W7
#   rank 2  ....F0F1..I0F2I1F3I2W0F4I3W1F5I4W2F6I5W3F7I6W4I7W5W6W7
#   rank 3  ......F0I0F1I1F2I2F3I3W0F4I4W1F5I5W2F6I6W3F7I7W4W5W6W7
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: bubble about a third of 1F1B's, at most p microbatches held."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        weights = 0
        for i in range(m):
            if warmup + i < m:
                acts.append(Action(r, F, warmup + i))
            acts.append(Action(r, I, i))
            if i >= r:
                acts.append(Action(r, W, weights))
                weights += 1
        acts += [Action(r, W, i) for i in range(weights, m)]
        ranks.append(tuple(acts))
    return Schedule(tuple(ranks), _chain(p), m, "zb_h1")


# ZB-H2 (zero-bubble): every rank may hold 2p-1 microbatches, so rank 0 keeps running
# forwards until the first input gradient arrives and the last rank defers its W passes to
# its drain; I has priority, then F, then W. Every rank is busy from its first to its last
# action (a parallelogram), so steps run back to back without a bubble when m >= 2p-1.
#
#   rank 0  F0F1F2F3F4F5F6I0W0I1F7I2W1I3W2I4W3I5W4I6W5W6I7W7
#   rank 1  ..F0F1F2F3F4I0F5I1F6I2W0I3F7I4W1I5W2I6W3W4I7W5W6W7
#   rank 2  ....F0F1F2I0F3I1F4I2F5I3F6I4W0I5F7I6W1W2I7W3W4W5W6W7
#   rank 3  ......F0I0F1I1F2I2F3I3F4I4F5I5F6I6W0F7I7W1W2W3W4W5W6W7
def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2: about zero bubble for steps run back to back, at most 2p-1 microbatches held."""
    p, m = check_count("num_stages", num_stages), check_count("num_microbatches", num_microbatches)
    order = list_schedule(_chain(p), m, [2 * p - 1] * p, split=True)
    return Schedule(tuple(tuple(acts) for acts in order), _chain(p), m, "zb_h2")


#: name -> generator taking (num_stages, num_microbatches, chunks).
SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "zb_h1": lambda p, m, v: zb_h1(p, m),
    "zb_h2": lambda p, m, v: zb_h2(p, m),
    **MULTISTAGE,
}


def make(name: str, num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """The schedule called ``name`` (a key of :data:`SCHEDULES`); ``chunks`` (stages per rank)
    is used by the multi-stage ones only (:mod:`xgrad.pipeline.multistage`)."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}")
    # Checked for every schedule, so a bad value is not silently ignored by the single-stage
    # ones (which place one stage per rank whatever it is); any integer type, numpy's too,
    # as the sizes.
    v = _as_int(chunks)
    if v is None or v < 1:
        raise ValueError(f"chunks must be a positive int (stages per rank), got {chunks!r}")
    check_size(num_stages, num_microbatches, v if name in MULTISTAGE else 1)
    return SCHEDULES[name](num_stages, num_microbatches, v)


def _as_int(value: object) -> int | None:
    """``value`` as an int where it is one of any integer type (numpy's too), not a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


#: the most (stage, microbatch) pairs :func:`make` builds: a million take a few seconds
#: and some hundred MB; far past that a typo (``-m 1000000000``) grew memory unbounded.
MAX_PAIRS = 1_000_000


def check_size(num_stages: object, num_microbatches: object, chunks: int = 1) -> None:
    """Refuse a schedule of more than :data:`MAX_PAIRS` (stage, microbatch) pairs, naming
    the values (integers of any type, numpy's too, as the generators take them: a numpy
    size went past this check and was built until memory ran out; other types are named by
    each generator's own check)."""
    p, m = _as_int(num_stages), _as_int(num_microbatches)
    if p is None or m is None:
        return
    pairs = p * m * chunks
    if pairs > MAX_PAIRS:
        raise ValueError(
            f"schedule too large: num_stages={p}, num_microbatches="
            f"{m}, chunks={chunks} make {pairs:,} (stage, microbatch) pairs, "
            f"more than {MAX_PAIRS:,}"
        )
