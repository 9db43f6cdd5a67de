"""A finished bucket's averages as the parameters' gradients: found, written back, lent.

Once a bucket's reduction is done (:meth:`~xgrad.reducer_buckets.BucketState.wait`),
its averages are in its own views, or in a new tensor a hook returned
(:func:`reduced_views`); each member not skipped gets its own, copied by ``set_grad`` or
lent as the view itself where the :class:`~xgrad.reducer_types.Lender` may
(:func:`write_back`); a bucket whose views were lent gets its buffer back, or a fresh one,
before it is filled again (:func:`reclaim`). Kept apart from :mod:`xgrad.reducer_buckets`
(which re-exports these), which lays the buckets out and fills them as gradients arrive:
this runs at the end of a pass (:mod:`xgrad.reducer_finalize`) and at the start of the
next fill, never per gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xgrad.reducer_types import ArrayOps, Lender

if TYPE_CHECKING:
    from xgrad.reducer_buckets import BucketState

__all__ = ["reclaim", "reduced_views", "views_of", "write_back"]


def reclaim(bucket: BucketState, lender: Lender, params: Sequence[Any], ops: ArrayOps) -> None:
    """Before a bucket with lent views is filled again: keep its buffer if they came back.

    A lent view that is still someone's gradient (``zero_grad(set_to_none=False)``) or
    is held anywhere else keeps the values it was lent with: the bucket then gets a
    fresh buffer (the old one belongs to its holders from now on).
    """
    if not lender.free(bucket.flat, bucket.in_views, bucket.lent):
        members = [params[i] for i in bucket.indices]
        bucket.flat = ops.new_flat(members, sum(ops.numel(p) for p in members))
        bucket.in_views = views_of(bucket.flat, bucket, params, ops)
    bucket.lent = []


def write_back(
    bucket: BucketState,
    views: Sequence[Any],
    skip: set[int] | frozenset[int],
    set_grad: Any,
    lender: Lender | None,
    set_grads: Any = None,
) -> None:
    """Give each member not in ``skip`` its reduced gradient: lent where the lender may.

    ``set_grads`` (``set_grad`` for the whole bucket in one call) is used when no member
    is skipped or may be lent.
    """
    lend = lender is not None and views is bucket.in_views
    if set_grads is not None and skip.isdisjoint(bucket.indices):
        if not lend:
            set_grads(bucket.indices, views)
            return
        if bucket.lendable is None:
            bucket.lendable = [k for k, i in enumerate(bucket.indices) if lender.lendable[i]]  # type: ignore[union-attr]
            bucket.plain = [k for k in range(len(bucket.indices)) if k not in bucket.lendable]
        if bucket.plain:
            set_grads([bucket.indices[k] for k in bucket.plain], [views[k] for k in bucket.plain])
        lendable = bucket.lendable
        lent = lender.lend_many(  # type: ignore[union-attr]
            [bucket.indices[k] for k in lendable], [views[k] for k in lendable]
        )
        for k, ok in zip(lendable, lent, strict=True):
            if ok:
                bucket.lent.append(k)
            else:
                set_grad(bucket.indices[k], views[k])
        return
    for k, i in enumerate(bucket.indices):
        if i in skip:
            continue
        if lend and lender.lendable[i] and lender.lend(i, views[k]):  # type: ignore[union-attr]
            bucket.lent.append(k)
        else:
            set_grad(i, views[k])


def reduced_views(
    bucket: BucketState,
    result: Any,
    params: Sequence[Any],
    ops: ArrayOps,
    *,
    gradient_as_bucket_view: bool,
) -> list[Any]:
    """Per member of a finished bucket, where its averaged gradient is.

    Normally the bucket's own views (the reduction ran in place). A hook that returned
    a new tensor (perhaps in another dtype, as mixed precision's does) is read from
    directly, as PyTorch does, unless the gradients are the bucket's views: then the
    result is copied into the bucket.
    """
    if bucket.sparse:
        return [bucket.flat if result is None else result]
    if result is None or ops.is_view_of(result, bucket.flat):
        return bucket.in_views
    if gradient_as_bucket_view:
        ops.copy_to(bucket.flat, result)
        return bucket.in_views
    return views_of(result, bucket, params, ops)


def views_of(flat: Any, bucket: BucketState, params: Sequence[Any], ops: ArrayOps) -> list[Any]:
    """Views of ``flat`` laid out as ``bucket`` (for a hook's result in a new tensor)."""
    views = []
    offset = 0
    for i in bucket.indices:
        views.append(ops.view(flat, offset, params[i]))
        offset += ops.numel(params[i])
    return views
