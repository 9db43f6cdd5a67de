"""An alpha-beta cost model of data-parallel iterations, for world sizes this machine lacks.

Ring allreduce of n bytes on N ranks: reduce-scatter then all-gather, ``N - 1`` steps each
moving ``n / N`` bytes::

    T_ring(n, N) = 2(N-1)·alpha + 2(N-1)/N·n·beta

Tree allreduce (reduce up a binary tree, broadcast down, whole message per step)::

    T_tree(n, N) = 2·ceil(log2 N)·(alpha + n·beta)

A DDP iteration: the forward pass, then the backward pass layer by layer (last layer
first); a bucket is launched when its last gradient is ready, buckets go over the link
one at a time in launch order, and the iteration ends when both the backward pass and the
last bucket are done. Without overlap every bucket waits for the end of the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "ALGORITHMS",
    "IterationModel",
    "buckets_by_cap",
    "ddp_iteration",
    "ring_allreduce",
    "tree_allreduce",
]


def _check(nbytes: float, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")


def ring_allreduce(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for a ring allreduce of ``nbytes`` per rank (0 on one rank)."""
    _check(nbytes, world_size)
    n = world_size
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def tree_allreduce(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for a binary-tree reduce then broadcast of ``nbytes`` (0 on one rank)."""
    _check(nbytes, world_size)
    if world_size == 1:
        return 0.0
    return 2 * math.ceil(math.log2(world_size)) * (alpha + nbytes * beta)


#: name -> allreduce cost function ``(nbytes, world_size, alpha, beta) -> seconds``.
ALGORITHMS: dict[str, Callable[[float, int, float, float], float]] = {
    "ring": ring_allreduce,
    "tree": tree_allreduce,
}


def buckets_by_cap(nbytes: Sequence[int], cap: int) -> list[list[int]]:
    """Group layer indices (given in backward order) into consecutive buckets of at most
    ``cap`` bytes; a layer larger than the cap gets a bucket of its own (DDP's rule)."""
    if cap < 1:
        raise ValueError(f"cap={cap} bytes must be >= 1")
    buckets: list[list[int]] = []
    size = 0
    for i, b in enumerate(nbytes):
        if buckets and size + b <= cap:
            buckets[-1].append(i)
            size += b
        else:
            buckets.append([i])
            size = b
    return buckets


@dataclass(frozen=True)
class IterationModel:
    """What :func:`ddp_iteration` predicts, in seconds.

    Attributes:
        iteration: forward + backward + the communication that is not hidden.
        compute: forward + backward.
        comm: the link's busy time (every bucket's allreduce).
        exposed: communication not hidden behind the backward pass.
        buckets: how many buckets.
    """

    iteration: float
    compute: float
    comm: float
    exposed: float
    buckets: int


def ddp_iteration(
    forward: float,
    backward: Sequence[float],
    nbytes: Sequence[int],
    cap: int,
    comm: Callable[[float], float],
    *,
    overlap: bool = True,
) -> IterationModel:
    """Model one DDP iteration.

    Args:
        forward: seconds of the forward pass.
        backward: seconds of each layer's backward, in backward order (last layer first).
        nbytes: each layer's gradient bytes, same order.
        cap: bucket cap in bytes.
        comm: allreduce seconds of a message of the given bytes.
        overlap: launch each bucket when ready (DDP) or only after the backward pass.
    """
    if len(backward) != len(nbytes):
        raise ValueError(f"{len(backward)} backward times for {len(nbytes)} layer sizes")
    ready = []
    t = forward
    for b in backward:
        t += b
        ready.append(t)
    end_backward = t
    link_free = 0.0
    busy = 0.0
    buckets = buckets_by_cap(nbytes, cap)
    for bucket in buckets:
        launch = ready[bucket[-1]] if overlap else end_backward
        cost = comm(sum(nbytes[i] for i in bucket))
        link_free = max(link_free, launch) + cost
        busy += cost
    end = max(end_backward, link_free)
    return IterationModel(
        iteration=end,
        compute=end_backward,
        comm=busy,
        exposed=end - end_backward,
        buckets=len(buckets),
    )
