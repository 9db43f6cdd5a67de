"""The reducer's flat bucket buffers: one per bucket of a plan, and where each gradient sits.

A plan says which parameters share a bucket; this module lays the bucket out (one zeroed
flat buffer, a view per member, in plan order) and keeps the per-bucket state of one
backward pass. A parameter whose gradient is sparse has a bucket of its own and no flat
buffer: its gradient tensor is reduced as it is, as PyTorch's reducer does. The state
machine in :mod:`xgrad.reducer` drives it. What a finished bucket's averages become (the
parameters' gradients, written back or lent) is :mod:`xgrad.reducer_views`, re-exported
here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from xgrad.backend import Work
from xgrad.buckets import BucketPlan
from xgrad.reducer_types import ArrayOps
from xgrad.reducer_views import reclaim as reclaim
from xgrad.reducer_views import reduced_views as reduced_views
from xgrad.reducer_views import views_of as views_of
from xgrad.reducer_views import write_back as write_back

#: a bucket whose gradients average fewer elements than this is copied in one batched
#: call and scaled in one pass; larger ones are scaled while copied (one pass each).
_ONE_PASS_NUMEL = 1 << 14

#: stands in ``BucketState.grads`` for a gradient copied in (scaled) when it arrived.
COPIED = object()


class BucketState:
    """The mutable per-bucket state (plain attributes: this is the per-hook hot path).

    ``grads`` holds, per member, the gradient handed in by its hook this iteration: the
    copy into the flat buffer is deferred until the bucket's last gradient arrives, so a
    bucket costs one batched copy instead of one copy call per parameter.
    """

    __slots__ = (
        "big",
        "finished_at",
        "flat",
        "grads",
        "in_views",
        "index",
        "indices",
        "launched_at",
        "lendable",
        "lent",
        "pending",
        "plain",
        "result",
        "skipped",
        "sparse",
        "waited",
        "work",
    )

    def __init__(
        self,
        index: int,
        indices: tuple[int, ...],
        flat: Any,
        in_views: list[Any],
        sparse: bool = False,
    ) -> None:
        self.index = index
        self.indices = indices
        self.flat = flat
        self.in_views = in_views
        self.sparse = sparse
        self.grads: list[Any] = [None] * len(indices)
        self.pending = len(indices)
        self.work: Work | None = None
        self.result: Any = None
        self.waited = False
        self.skipped = False
        self.launched_at = 0.0
        self.finished_at = 0.0
        #: members whose view was lent out as their gradient (kept across iterations).
        self.lent: list[int] = []
        #: members that may be lent, and the others (found at the first call of
        #: :func:`~xgrad.reducer_views.write_back`).
        self.lendable: list[int] | None = None
        self.plain: list[int] = []
        #: per member, whether it is copied in as soon as it arrives (see :func:`arrive`).
        self.big = [False] * len(indices)

    def reset(self) -> None:
        """Forget the last iteration (called when a synchronised backward pass is expected)."""
        self.pending = len(self.indices)
        self.grads = [None] * len(self.indices)
        self.work = None
        self.result = None
        self.waited = False
        self.skipped = False
        if self.sparse:
            self.flat = None

    def wait(self, clock: Callable[[], float]) -> Any:
        """The reduction's result, waiting for it once."""
        if not self.waited:
            assert self.work is not None
            self.result = self.work.wait()
            self.finished_at = clock()
            self.waited = True
        return self.result


def build_buckets(
    plan: BucketPlan,
    params: Sequence[Any],
    ops: ArrayOps,
    keys: Sequence[Hashable],
    sparse: Sequence[bool] | None = None,
) -> tuple[list[BucketState], list[tuple[BucketState, int]]]:
    """The buckets of ``plan`` over ``params``, and per parameter its (bucket, slot).

    Raises:
        ValueError: a bucket of the plan mixes keys (dtypes or devices), or puts a
            parameter with a sparse gradient together with others.
    """
    for b, members_of_b in enumerate(plan.buckets):
        mixed = {keys[i] for i in members_of_b}
        if len(mixed) > 1:
            raise ValueError(f"bucket {b} of the plan mixes {sorted(map(str, mixed))}")
        if sparse is not None and len(members_of_b) > 1 and any(sparse[i] for i in members_of_b):
            raise ValueError(
                f"bucket {b} of the plan holds {list(members_of_b)}: a parameter with a "
                "sparse gradient needs a bucket of its own"
            )
    buckets: list[BucketState] = []
    locate: list[tuple[BucketState, int]] = [None] * len(params)  # type: ignore[list-item]
    for b, indices in enumerate(plan.buckets):
        if sparse is not None and sparse[indices[0]]:
            bucket = BucketState(b, indices, None, [None], sparse=True)
        else:
            members = [params[i] for i in indices]
            offsets: list[int] = []
            total = 0
            for p in members:
                offsets.append(total)
                total += ops.numel(p)
            flat = ops.new_flat(members, total)
            views = [ops.view(flat, off, p) for off, p in zip(offsets, members, strict=True)]
            bucket = BucketState(b, indices, flat, views)
            bucket.big = [ops.numel(p) >= _ONE_PASS_NUMEL for p in members]
        buckets.append(bucket)
        for k, i in enumerate(indices):
            locate[i] = (bucket, k)
    return buckets, locate


def arrive(bucket: BucketState, k: int, grad: Any, ops: ArrayOps, scale: float | None) -> None:
    """Member ``k``'s gradient arrived: a large one is copied in (scaled) now, else kept.

    Copying a large gradient the moment autograd made it reads it while it is still in
    cache (PyTorch's reducer copies each gradient in its hook too); small ones wait for
    the bucket's one batched copy. ``scale`` ``None``: no early copy (a hook divides, or
    the copy is of another kind); the arithmetic is :func:`fill_bucket`'s either way.
    A gradient of another dtype than its bucket is kept for :func:`fill_bucket` to refuse.
    """
    if (
        scale is not None
        and grad is not None
        and bucket.big[k]
        and ops.dtype_mismatch(bucket.flat, (grad,)) is None
    ):
        ops.copy_to(bucket.in_views[k], grad, scale)
        grad = COPIED
    bucket.grads[k] = grad


def fill_bucket(
    bucket: BucketState,
    ops: ArrayOps,
    scale: float | None,
    world_size: int,
    *,
    gradient_as_bucket_view: bool,
    batched_grad_copy: bool,
    point: Callable[[Sequence[int], Sequence[Any]], None] | None = None,
) -> tuple[int, str, str] | None:
    """Copy a complete bucket's gradients in, pre-divided, with batched array calls.

    The arithmetic is PyTorch's: by default each gradient is multiplied by
    ``scale = 1/world_size`` as it is copied (a gradient that already is its bucket view
    is divided in place); with ``batched_grad_copy`` the whole bucket is divided once
    after the copies. A sparse gradient's copy is divided in place and becomes the
    bucket's buffer (PyTorch divides and reduces the gradient itself, in place: two
    sparse gradients that share their values, one upstream gradient into two
    embeddings, were reduced into each other). ``scale`` is ``None`` when a
    communication hook divides.

    Returns:
        ``None``; or, copying nothing, ``(parameter index, its gradient's dtype, the
        bucket's dtype)`` for a gradient whose dtype is not its bucket's (the module was
        converted after the buckets were made), where a copy would round it to the bucket's
        dtype without a word (PyTorch's DDP reduces nothing then: its hooks stay on the
        gradient accumulators the conversion replaced). Under
        ``gradient_as_bucket_view`` the conversion replaced the data of the gradients that
        were the bucket's views, so those views are checked too: left, they were left out
        of the buffer that is reduced. A sparse gradient has no buffer to round it.

    ``point``: under ``gradient_as_bucket_view``, called once the copies are made with
    the parameter indices and views of the gradients copied in (not yet views: the
    first pass's, or after ``zero_grad()``), to make those views the gradients before
    the bucket's hook runs, as PyTorch's reducer does when it marks one ready. A pass
    whose gradients all are views already (every later one) calls nothing.
    """
    grads = bucket.grads
    if bucket.sparse:
        flat = ops.clone(grads[0])
        if scale is not None:
            ops.div_(flat, world_size)  # in place, as PyTorch's reducer does
        bucket.flat = flat
        return None
    views = bucket.in_views
    dst: list[Any] = []
    src: list[Any] = []
    aliased: list[Any] = []
    early = False
    for k, grad in enumerate(grads):
        if grad is COPIED:
            early = True
        elif grad is None:
            ops.zero_(views[k])
        elif gradient_as_bucket_view and ops.is_view_of(grad, views[k]):
            aliased.append(views[k])  # autograd accumulated straight into the bucket
        else:
            dst.append(views[k])
            src.append(grad)
    # The copies are made: hold no gradient past them (a lender counts who holds one).
    bucket.grads = [None] * len(grads)
    wrong = _wrong_dtype(bucket, ops, grads, src)
    if wrong is None and aliased:
        wrong = _wrong_dtype(bucket, ops, views, aliased)
    if wrong is not None:
        return wrong
    _copy_in(bucket, ops, dst, src, aliased, scale, world_size, batched_grad_copy, early)
    if point is not None and dst:
        # dst is views' subsequence: the members copied in, found by identity in order.
        moved: list[int] = []
        for k, view in enumerate(views):
            if len(moved) < len(dst) and view is dst[len(moved)]:
                moved.append(k)
        point([bucket.indices[k] for k in moved], dst)
    return None


def _copy_in(
    bucket: BucketState,
    ops: ArrayOps,
    dst: list[Any],
    src: list[Any],
    aliased: list[Any],
    scale: float | None,
    world_size: int,
    batched_grad_copy: bool,
    early: bool,
) -> None:
    """:func:`fill_bucket`'s copies of ``src`` into ``dst`` and its division."""
    if batched_grad_copy:
        if dst:
            ops.copy_all(dst, src, None)
        if scale is not None:
            ops.div_(bucket.flat, world_size)
        return
    if (
        scale is not None
        and not (aliased or early)
        and len(dst) * _ONE_PASS_NUMEL > ops.numel(bucket.flat)
    ):
        # Many small gradients: copy them all in one batched call, then scale the whole
        # bucket in one pass (same rounding as scaling each while copying; zeros stay 0).
        ops.copy_all(dst, src, None)
        ops.copy_to(bucket.flat, bucket.flat, scale)
        return
    if dst:
        ops.copy_all(dst, src, scale)
    if aliased and scale is not None:
        ops.div_all(aliased, world_size)


def _wrong_dtype(
    bucket: BucketState, ops: ArrayOps, members: Sequence[Any], xs: Sequence[Any]
) -> tuple[int, str, str] | None:
    """:meth:`~xgrad.reducer_types.ArrayOps.dtype_mismatch` of ``xs`` (some of
    ``members``, the bucket's gradients or views) against the bucket, with the
    parameter's index in place of the position in ``xs``."""
    found = ops.dtype_mismatch(bucket.flat, xs)
    if found is None:
        return None
    k, dtype, expected = found
    member = next(m for m, x in enumerate(members) if x is xs[k])
    return bucket.indices[member], dtype, expected
