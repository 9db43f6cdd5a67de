"""The reducer's per-gradient marks: a parameter's gradient is ready, its bucket counts down.

This is the hot path of a backward pass (PyTorch's ``mark_variable_ready``): each
gradient hook calls :meth:`GradientMarks.mark_ready` (or :meth:`~GradientMarks.mark_many`
for several that arrived together), which notes the gradient in its bucket and, when the
bucket's last one arrived, fills the bucket and launches what is ready in bucket order
(:mod:`xgrad.reducer_launch`). The first mark of a pass starts its clock and marks the
parameters found unused. Kept apart from :mod:`xgrad.reducer` (whose class mixes this
in), which builds the reducer and prepares each pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from xgrad.reducer_buckets import arrive
from xgrad.reducer_errors import marked_ready_twice, static_graph_now_used
from xgrad.reducer_views import reclaim

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.reducer_buckets import BucketState
    from xgrad.reducer_static import HookCounts
    from xgrad.reducer_types import ArrayOps, Lender
    from xgrad.reducer_unused import UnusedParams


class GradientMarks:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    params: list[Any]
    comm: Comm
    ops: ArrayOps
    names: list[str]
    clock: Callable[[], float]
    lender: Lender[Any] | None
    get_grad: Callable[[int], Any] | None
    find_unused_parameters: bool
    static_graph: bool
    marking: int
    _expect_hooks: bool
    _require_finalize: bool
    _marked_unused: bool
    _counts: HookCounts
    _unused: UnusedParams
    _ready: bytearray
    _ready_order: list[int]
    _ready_times: list[float]
    _backward_start: float
    _locate: list[tuple[BucketState, int]]
    _early: float | None

    if TYPE_CHECKING:  # the reducer's and BucketLaunches' (a stub here would shadow them)

        @property
        def _delay_launch(self) -> bool: ...

        @property
        def _skip_agreed(self) -> bool: ...

        @property
        def _search(self) -> dict[str, bool]: ...

        def _fill(self, bucket: BucketState) -> None: ...

        def _launch_ready_buckets(self) -> None: ...

    def mark_ready(self, index: int, grad: Any) -> None:
        """A parameter's gradient is complete (call from its post-accumulate hook).

        ``grad`` is the accumulated gradient, so gradients accumulated under ``no_sync``
        are reduced with this one. Does nothing when no synced backward is expected.
        """
        if not self._expect_hooks:
            self._used_unsynced(index, grad)
            return
        now = self.clock()
        if not self._marked_unused:
            self._begin_at(now)
        if self.static_graph and self._counts.hold(index, grad, now, self._delay_launch):
            self._require_finalize = True
            return
        if grad is None:
            self._no_gradient(index)
        self._mark(index, grad, now)

    def _used_unsynced(self, index: int, grad: Any) -> None:
        """A gradient outside a synchronised pass (``no_sync``): under
        ``find_unused_parameters`` it counts as used in the next synchronised pass's used
        map, as DDP's local used map keeps counting during ``no_sync`` (so a parameter
        used only in an accumulation pass is still averaged, not left local)."""
        if grad is not None and self.find_unused_parameters and not self.static_graph:
            self._unused.used_unsynced.add(index)

    def _no_gradient(self, index: int) -> None:
        """A hook fired without a gradient (an output the loss left out, see ddp_sink).

        Under ``find_unused_parameters`` the parameter counts as unused on this rank, as
        PyTorch's local used map counts defined gradients only: a parameter no rank gave
        a gradient keeps ``.grad`` untouched.
        """
        if self.find_unused_parameters and not self.static_graph:
            self._unused.local.append(index)

    def sum_used_map(self) -> None:
        """Start the used-map sum now, if this pass's buckets skip by it: at the pass's
        first mark, and before a reduction outside the buckets (DDP's
        ``delay_all_reduce_named_params``), which every rank reaches at the same point
        of its backward pass.

        A rank marks its first gradient late when its early ones only logged their
        arrival (or none came before the hooked one): from the first mark alone, two
        ranks that used different parameters entered the sum and the delayed all-reduce
        in different orders, and gloo paired the two (without a word where they had the
        same size) or aborted both processes. A no-op where it is out already, or where
        nothing skips by it.
        """
        if self._expect_hooks and self._skip_agreed:
            self._unused.launch(self.comm, self.ops, self.params[0], **self._search)

    def _begin_at(self, now: float) -> None:
        """The pass's first mark: it starts the clock and marks the unused parameters."""
        self._marked_unused = True
        self._backward_start = now
        self.sum_used_map()  # the used map first, on every rank: buckets skip by it
        get = self.get_grad
        for i in self._unused.local:
            self._mark(i, None if get is None else get(i), now)

    @property
    def expecting(self) -> bool:
        """Whether a synchronised backward pass is prepared and its hooks still count."""
        return self._expect_hooks

    def mark_many(self, indices: Sequence[int], grads: Sequence[Any]) -> None:
        """:meth:`mark_ready` for gradients that arrived in this order, in one call.

        The same marks, in the same order, as one :meth:`mark_ready` per gradient; they
        share one timestamp. When one raises, :attr:`marking` is the index it raised on.
        """
        if not self._expect_hooks or not indices:
            for index, grad in zip(indices, grads, strict=True):
                self._used_unsynced(index, grad)
            return
        if self.static_graph and self._counts.active(self._delay_launch):
            for self.marking, grad in zip(indices, grads, strict=True):
                self.mark_ready(self.marking, grad)
            return
        now = self.clock()
        if not self._marked_unused:
            self._begin_at(now)
        for index, grad in zip(indices, grads, strict=True):
            self.marking = index
            if grad is None:
                self._no_gradient(index)
            self._mark(index, grad, now)

    def _mark(self, index: int, grad: Any, now: float) -> None:
        if self._ready[index]:
            if self.static_graph and index in (self._unused.static or ()):
                raise static_graph_now_used(index, self.names, self.comm.rank)
            raise marked_ready_twice(index, self.names, self.comm.rank)
        self._ready[index] = 1
        self._ready_order.append(index)
        self._ready_times.append(now)
        self._require_finalize = True
        bucket, k = self._locate[index]
        if bucket.lent and bucket.pending == len(bucket.indices):  # before its first write
            reclaim(bucket, self.lender, self.params, self.ops)  # type: ignore[arg-type]
        arrive(bucket, k, grad, self.ops, self._early)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._fill(bucket)
            if not self._delay_launch:
                self._launch_ready_buckets()
