"""Lanes: a pipeline step's messages between two ranks go on one private group per
direction, so that two ranks sending to each other at once never queue behind each other.

Gloo holds a lock per connection (a pair of ranks in a group) while it writes a message,
and a rank's "ready" for a posted receive and its own sends share that connection. In
1F1B the two ranks of a pair send at once all through the steady state (one its
activation, the other its gradient), and one of them stalled 1-5 ms behind the other: the
bench's simulator measured 2.5 ms per message at p = 2 where a ping-pong takes 0.24 ms.
With two lanes, lane 0 carries every message from a lower pipeline rank to a higher one
(forward activations, in most schedules) and lane 1 the others, so on each connection
the data goes one way only.

A second group costs connections and a transport thread per rank, which pays only where
every rank on this machine has a core of its own (``$LOCAL_WORLD_SIZE`` ranks, as
torchrun sets it, else the pipeline's size, against the CPUs this process may use); the
count can be set with ``$XGRAD_PIPELINE_LANES`` (1 or 2). Ranks that opened a different
number of groups would wait in ``dist.new_group`` for ever, so every rank reads every
rank's count before any group is made and all open the fewest: machines with fewer cores
than ranks, or one node's setting, make the whole pipeline use one lane (a choice of
speed, not of correctness, so it is not refused).

The lanes are gloo groups whatever the pipeline's group is: the step's protocol needs what
gloo's point-to-point gives and NCCL's does not (tags that keep a message's header, its
description and its leaves apart; a receive that a shorter message completes, as the
header-only messages, the poison and a changed description do; receives posted ahead
that never hold up a send to the same peer: NCCL ignores tags, needs exact sizes and puts
a pair's sends and receives on one stream). GPU stages' messages then go through host
memory (``pipeline_edges.EdgeBook``): slower than NCCL would be, not wrong.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from xgrad.torch_backend.private_groups import private_group

__all__ = ["LANES_ENV", "agree_lanes", "default_lanes", "lane_of", "open_lanes"]

#: environment variable that sets the number of lanes (1 or 2).
LANES_ENV = "XGRAD_PIPELINE_LANES"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_lanes(world_size: int) -> int:
    """The number of private groups a step uses: ``$XGRAD_PIPELINE_LANES``, else 2 where
    every rank on this machine (``$LOCAL_WORLD_SIZE``, else ``world_size``) has a CPU of
    its own, else 1.

    Raises:
        ValueError: either variable is not a number, or the lane count is not 1 or 2.
    """
    env = os.environ.get(LANES_ENV)
    if env is not None:
        if env.strip() not in ("1", "2"):
            raise ValueError(f"{LANES_ENV}={env!r}: expected 1 or 2")
        return int(env)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        ranks = world_size if local is None else int(local)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a number of ranks") from None
    return 2 if ranks <= _usable_cpus() else 1


def lane_of(sender: int, receiver: int, lanes: int) -> int:
    """The lane of a message from pipeline rank ``sender`` to ``receiver``."""
    return 0 if lanes == 1 or sender < receiver else 1


def agree_lanes(counts: Sequence[int]) -> int:
    """The lanes every rank opens: the fewest any rank asked for (``counts``, every rank's,
    read alike on every rank, so all open the same number)."""
    if not counts or any(c not in (1, 2) for c in counts):
        raise ValueError(f"lane counts {list(counts)}: expected 1 or 2 from every rank")
    return min(counts)


def open_lanes(members: Sequence[int], lanes: int, parent: Any = None) -> tuple[Any, ...]:
    """``lanes`` private gloo groups of ``members`` (global ranks, those of ``parent``),
    made alike on every rank."""
    return tuple(private_group(members, parent=parent, backend="gloo") for _ in range(lanes))
