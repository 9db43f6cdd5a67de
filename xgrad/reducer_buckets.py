"""The reducer's flat bucket buffers: one per bucket of a plan, and where each gradient sits.

A plan says which parameters share a bucket; this module lays the bucket out (one zeroed
flat buffer, a view per member, in plan order) and keeps the per-bucket state of one
backward pass. The state machine in :mod:`xgrad.reducer` drives it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from xgrad.backend import Work
from xgrad.buckets import BucketPlan
from xgrad.reducer_types import ArrayOps


class BucketState:
    """The mutable per-bucket state (plain attributes: this is the per-hook hot path)."""

    __slots__ = (
        "finished_at",
        "flat",
        "in_views",
        "index",
        "indices",
        "launched_at",
        "pending",
        "result",
        "waited",
        "work",
    )

    def __init__(
        self, index: int, indices: tuple[int, ...], flat: Any, in_views: list[Any]
    ) -> None:
        self.index = index
        self.indices = indices
        self.flat = flat
        self.in_views = in_views
        self.pending = len(indices)
        self.work: Work | None = None
        self.result: Any = None
        self.waited = False
        self.launched_at = 0.0
        self.finished_at = 0.0

    def wait(self, clock: Callable[[], float]) -> Any:
        """The reduction's result, waiting for it once."""
        if not self.waited:
            assert self.work is not None
            self.result = self.work.wait()
            self.finished_at = clock()
            self.waited = True
        return self.result


def build_buckets(
    plan: BucketPlan, params: Sequence[Any], ops: ArrayOps, keys: Sequence[Hashable]
) -> tuple[list[BucketState], list[tuple[BucketState, int]]]:
    """The buckets of ``plan`` over ``params``, and per parameter its (bucket, slot).

    Raises:
        ValueError: a bucket of the plan mixes keys (dtypes or devices).
    """
    for b, members_of_b in enumerate(plan.buckets):
        mixed = {keys[i] for i in members_of_b}
        if len(mixed) > 1:
            raise ValueError(f"bucket {b} of the plan mixes {sorted(map(str, mixed))}")
    buckets: list[BucketState] = []
    locate: list[tuple[BucketState, int]] = [None] * len(params)  # type: ignore[list-item]
    for b, indices in enumerate(plan.buckets):
        members = [params[i] for i in indices]
        offsets: list[int] = []
        total = 0
        for p in members:
            offsets.append(total)
            total += ops.numel(p)
        flat = ops.new_flat(members, total)
        views = [ops.view(flat, off, p) for off, p in zip(offsets, members, strict=True)]
        bucket = BucketState(b, indices, flat, views)
        buckets.append(bucket)
        for k, i in enumerate(indices):
            locate[i] = (bucket, k)
    return buckets, locate
