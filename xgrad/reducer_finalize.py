"""The end of a backward pass: every bucket waited for, gradients written back, the pass recorded.

Kept apart from the state machine in :mod:`xgrad.reducer` (whose class mixes this in)
because it runs once per pass, not per gradient: after the last hook it launches what a
first static-graph pass delayed, refuses a pass that left parameters waiting, waits for
each bucket's reduction, writes the averages back, keeps the ready order for the one
rebuild and appends the pass's :class:`~xgrad.reducer_types.IterationRecord`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from xgrad.reducer_errors import buckets_never_reduced, static_graph_now_unused
from xgrad.reducer_types import IterationRecord
from xgrad.reducer_views import reduced_views, write_back

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.reducer_buckets import BucketState
    from xgrad.reducer_static import HookCounts
    from xgrad.reducer_types import ArrayOps, Lender
    from xgrad.reducer_unused import UnusedParams


class EndOfPass:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    params: list[Any]
    comm: Comm
    ops: ArrayOps
    names: list[str]
    clock: Callable[[], float]
    set_grad: Callable[[int, Any], None]
    set_grads: Callable[[Sequence[int], Sequence[Any]], None] | None
    lender: Lender[Any] | None
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    records: deque[IterationRecord]
    num_iterations: int
    has_rebuilt_buckets: bool
    _expect_hooks: bool
    _require_finalize: bool
    _marked_unused: bool
    _counts: HookCounts
    _unused: UnusedParams
    _buckets: list[BucketState]
    _next_bucket: int
    _ready_order: list[int]
    _ready_times: list[float]
    _backward_start: float
    _rebuild_order: list[int] | None
    _plan_digest: str

    if TYPE_CHECKING:  # the reducer's and BucketLaunches' (a stub here would shadow them)

        @property
        def _delay_launch(self) -> bool: ...

        @property
        def _search(self) -> dict[str, bool]: ...

        def _mark(self, index: int, grad: Any, now: float) -> None: ...

        def _missing(self) -> list[int]: ...

        def _launch_ready_buckets(self) -> None: ...

    def finalize(self) -> None:
        """End of the backward pass: wait for every bucket and write gradients back.

        Unlike DDP (which notices at the next iteration), a pass that ended with
        parameters still waiting for a gradient raises here (and again at the next
        forward), so no step is taken on half-reduced gradients. Parameters no rank
        used keep their gradient untouched, as in DDP.
        """
        if not self._expect_hooks:
            return
        if not self._marked_unused:
            # No hook fired: nothing to reduce.
            self._expect_hooks = False
            return
        delayed = self._delay_launch
        if delayed:
            # DDP's delayed allreduce: the first static-graph iteration learns which
            # parameters are unused, then reduces every bucket at once.
            for i, grad, when in self._counts.release():
                self._mark(i, grad, when)
            for i in self._unused.learn(self._missing()):
                self._mark(i, None, self.clock())
            self._launch_ready_buckets()
        if self._next_bucket < len(self._buckets):
            if self.static_graph and not delayed:
                raise static_graph_now_unused(self._missing(), self.names, self.comm.rank)
            raise buckets_never_reduced(
                self._missing(), self.names, self.comm.rank, self.find_unused_parameters
            )
        globally_unused = self._unused.on_every_rank(
            self.comm, self.ops, self.params[0], **self._search
        )
        for bucket in self._buckets:
            if bucket.skipped:
                continue  # its parameters are unused: their gradients stay untouched
            views = reduced_views(
                bucket,
                bucket.wait(self.clock),
                self.params,
                self.ops,
                gradient_as_bucket_view=self.gradient_as_bucket_view,
            )
            write_back(bucket, views, globally_unused, self.set_grad, self.lender, self.set_grads)
        end = self.clock()
        if self._rebuild_order is None and not self.has_rebuilt_buckets and not delayed:
            self._rebuild_order = self._unused.rebuild_order(self._ready_order)
        self.records.append(
            IterationRecord.of(
                self.num_iterations,
                self._plan_digest,
                self._ready_order,
                self._ready_times,
                self._buckets,
                (self._backward_start, end),
                self._unused.current,
            )
        )
        self.num_iterations += 1
        self._expect_hooks = False
        self._require_finalize = False
