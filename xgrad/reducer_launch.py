"""Launching a backward pass's buckets: in bucket order, through the group or the hook.

Every rank must issue the same collectives in the same order, so a bucket that is
complete waits for every bucket before it; the used-parameter map (when one is summed)
goes out after the last. Kept apart from the state machine in :mod:`xgrad.reducer`
(whose class mixes this in), which decides when a bucket is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from xgrad.reducer_buckets import fill_bucket
from xgrad.reducer_errors import gradient_dtype_mismatch, sparse_gradient_missing
from xgrad.reducer_types import GradBucket

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.reducer_buckets import BucketState
    from xgrad.reducer_types import ArrayOps, Hook
    from xgrad.reducer_unused import UnusedParams


class BucketLaunches:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    params: list[Any]
    comm: Comm
    ops: ArrayOps
    clock: Callable[[], float]
    find_unused_parameters: bool
    static_graph: bool
    skip_all_reduce_unused_params: bool
    names: list[str]
    gradient_as_bucket_view: bool
    batched_grad_copy: bool
    _scale: float | None
    _divisor: int
    _buckets: list[BucketState]
    _next_bucket: int
    _unused: UnusedParams
    #: under ``gradient_as_bucket_view``: makes the given parameters' gradients the given
    #: bucket views (set by the DDP; see :func:`~xgrad.reducer_buckets.fill_bucket`).
    point_grads: Callable[[Sequence[int], Sequence[Any]], None] | None = None

    if TYPE_CHECKING:  # LateSetup's properties (a stub here would shadow them)

        @property
        def hook(self) -> Hook | None: ...

        @property
        def serial_hooks(self) -> bool: ...

    def _fill(self, bucket: BucketState) -> None:
        """A bucket's last gradient arrived: copy its gradients in (launched in order);
        one of another dtype than the bucket is refused (:func:`gradient_dtype_mismatch`)."""
        if bucket.sparse and bucket.grads[0] is None:
            raise sparse_gradient_missing(bucket.indices[0], self.names, self.comm.rank)
        wrong = fill_bucket(
            bucket,
            self.ops,
            self._scale,
            self._divisor,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            batched_grad_copy=self.batched_grad_copy,
            point=self.point_grads,
        )
        if wrong is not None:
            raise gradient_dtype_mismatch(*wrong, self.names, self.comm.rank)

    def _launch_ready_buckets(self) -> None:
        """Launch buckets in bucket order: a ready bucket waits for all before it."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            if self.skip_all_reduce_unused_params and self._all_unused(bucket):
                bucket.skipped = True
            else:
                self._launch(bucket)
            self._next_bucket += 1
        if self._next_bucket == len(buckets):
            self._unused.launch(self.comm, self.ops, self.params[0], **self._search)

    @property
    def _search(self) -> dict[str, bool]:
        return {"find_unused": self.find_unused_parameters, "static_graph": self.static_graph}

    @property
    def _skip_agreed(self) -> bool:
        """``skip_all_reduce_unused_params`` with unused parameters searched every pass:
        a bucket is skipped only where no rank used it, read from the used map summed at
        the start of the backward pass. PyTorch's skips what this rank did not use, and
        ranks that disagree enter different collectives (gloo aborts the process)."""
        return (
            self.skip_all_reduce_unused_params
            and self.find_unused_parameters
            and not self.static_graph
        )

    def _all_unused(self, bucket: BucketState) -> bool:
        if not set(bucket.indices) <= set(self._unused.current):
            return False
        if not self._skip_agreed:
            return True
        found = self._unused.on_every_rank(
            self.comm, self.ops, self.params[0], **self._search, keep=True
        )
        return set(bucket.indices) <= found

    def _launch(self, bucket: BucketState) -> None:
        if self.serial_hooks and self.hook is not None:
            # The last bucket launched before this one (a skipped one has no reduction).
            for before in reversed(self._buckets[: bucket.index]):
                if before.work is not None:
                    before.wait(self.clock)
                    break
        bucket.launched_at = self.clock()
        if self.hook is None:
            bucket.work = self.comm.allreduce(bucket.flat)
        else:
            members = [self.params[i] for i in bucket.indices]
            view = GradBucket(
                bucket.index,
                bucket.flat,
                list(bucket.in_views),
                members,
                bucket.index == len(self._buckets) - 1,
            )
            bucket.work = self.hook(view)
