"""The reducer off the happy path: a pass that failed part-way, and a rank with no input left.

Kept apart from the state machine in :mod:`xgrad.reducer` (whose class mixes this in) because
neither runs per gradient: a failed pass is dropped once, at the next forward, with a
message that says what was dropped; a joined rank (``join()``) enters each backward pass
of the others with zeros, so their collectives find a partner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xgrad.reducer_buckets import COPIED, BucketState, build_buckets

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.buckets import BucketPlan
    from xgrad.reducer_static import HookCounts
    from xgrad.reducer_types import ArrayOps
    from xgrad.reducer_unused import UnusedParams


@dataclass(frozen=True)
class StepState:
    """What the reducer learned by a step's start (:meth:`JoinAndRecovery.step_state`)."""

    static: list[int] | None  # a static graph's unused parameters (None: not learned)
    learned: list[int] | None  # its hooks per parameter per iteration
    repeats: bool
    rebuild_order: list[int] | None  # the ready order kept for the one rebuild
    rebuilt: bool  # whether the buckets were rebuilt


class JoinAndRecovery:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    # The reducer's attributes these methods use.
    params: list[Any]
    plan: BucketPlan
    comm: Comm
    ops: ArrayOps
    keys: list[Any]
    sparse: list[bool]
    names: list[str]
    clock: Callable[[], float]
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    point_grads: Callable[[Sequence[int], Sequence[Any]], None] | None
    has_rebuilt_buckets: bool
    num_iterations: int
    _buckets: list[BucketState]
    _rebuild_order: list[int] | None
    _ready: bytearray
    _next_bucket: int
    _scale: float | None
    _divisor: int
    _expect_hooks: bool
    _require_finalize: bool
    _marked_unused: bool
    _failure: str | None = None
    _unused: UnusedParams
    _counts: HookCounts
    _hook: Any
    _serial_hooks: bool

    def _launch(self, bucket: BucketState) -> None: ...  # defined by the reducer

    if TYPE_CHECKING:  # LateSetup's and BucketLaunches': no stub here (it would shadow them)

        def _set_hook(self, hook: Any, serial: bool) -> None: ...

        @property
        def _skip_agreed(self) -> bool: ...

    # ----------------------------------------------------------------- recovery

    def fail(self, reason: str) -> None:
        """Record that the backward pass under way failed (``reason`` names rank and where).

        The next :meth:`recover` then drops it instead of reporting the parameters that
        never got a gradient as unused, which is not what happened.
        """
        if (self._expect_hooks or self._require_finalize) and self._failure is None:
            self._failure = reason

    def all_ready(self) -> bool:
        """Whether every gradient of the pass under way has been marked ready."""
        return all(self._ready)

    @property
    def failure(self) -> str | None:
        """Why the pass under way failed, if it did."""
        return self._failure

    def recover(self) -> str | None:
        """Drop a pass that failed part-way; say what was dropped (``None``: nothing to do).

        Buckets already launched have finished or failed with their collective; nothing
        of the pass reaches ``.grad`` beyond what autograd itself accumulated there.
        """
        if self._failure is None:
            return None
        ready, n = sum(self._ready), len(self.params)
        dropped = (
            f"iteration {self.num_iterations} failed ({self._failure}); dropped: {ready} of {n} "
            f"gradients ready, {self._next_bucket} of {len(self._buckets)} buckets launched, "
            "none written back"
        )
        self._drop_pass()
        return dropped

    def drop_prepared(self) -> None:
        """Drop a synchronised pass that was prepared (:meth:`prepare_for_backward`) and
        whose backward never began: its step was given up around the DDP (a pipeline step
        that failed between a stage's synchronised forward and backward passes).

        Left expecting, the reducer took the next ``no_sync`` backward pass for it (as it
        should after a pass every rank skipped alike, not after one given up): its
        gradients were launched, never finalized, and the pass after raised the "prior
        iteration" error with no parameter missing. Nothing of the dropped pass reached
        a bucket or ``.grad``, so there is nothing to report (unlike :meth:`recover`).
        """
        self._drop_pass()

    def leave_in_views(self) -> None:
        """A pass left unfinished whose gradients stay (a ``no_sync`` pass the reducer
        reduced): under ``gradient_as_bucket_view``, each gradient marked ready in a bucket
        never filled goes where PyTorch's reducer puts it as it marks it ready, its bucket
        view, divided by the divisor unless a communication hook divides (one that is the
        view already: divided in place), and becomes that view (``point_grads``). Filled
        buckets did so as they filled (:func:`~xgrad.reducer_buckets.fill_bucket`)."""
        point = self.point_grads
        if not self.gradient_as_bucket_view or point is None:
            return
        ops = self.ops
        for bucket in self._buckets[self._next_bucket :]:
            if bucket.pending == 0 or bucket.sparse:
                continue
            indices: list[int] = []
            views: list[Any] = []
            for k, grad in enumerate(bucket.grads):
                view = bucket.in_views[k]
                if grad is None or grad is COPIED or ops.dtype_mismatch(view, (grad,)):
                    continue  # (another dtype: a module converted since, left as it is)
                if ops.is_view_of(grad, view):
                    if self._scale is not None:
                        ops.div_(view, self._divisor)
                else:
                    ops.copy_to(view, grad, self._scale)
                    indices.append(bucket.indices[k])
                    views.append(view)
                bucket.grads[k] = None
            if indices:
                point(indices, views)

    def _drop_pass(self) -> None:
        self._failure = None
        self._expect_hooks = self._require_finalize = self._marked_unused = False
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        for bucket in self._buckets:
            bucket.reset()

    def step_state(self) -> StepState:
        """What a step's passes teach the reducer once and for all, as it stands: a static
        graph's unused set and hook counts (its first iteration), the ready order kept for
        the rebuild. Taken at each step's start (references: each is replaced, not
        changed), for :meth:`restore_step_state` if the step fails."""
        counts = self._counts
        return StepState(
            self._unused.static,
            counts.learned,
            counts.repeats,
            self._rebuild_order,
            self.has_rebuilt_buckets,
        )

    def restore_step_state(self, state: StepState) -> None:
        """Undo what a failed step taught: the ranks learn it again alike in a later one.

        A step that failed may have ended on one rank (which learned a static graph's first
        iteration, or kept a ready order) and not on another (which failed before): left
        so, the ranks took different paths from then on (one rebuilding its buckets while
        the other learned), each step's collectives unmatched until the timeout.
        """
        self._unused.static, self._counts.learned = state.static, state.learned
        self._counts.repeats, self._rebuild_order = state.repeats, state.rebuild_order
        # A rebuild's broadcast that completed on one rank may have raised a peer's failure
        # on another: every rank rebuilds again (its plan, rank 0's, the one already taken
        # where the broadcast completed), or one would broadcast alone at the next step.
        self.has_rebuilt_buckets = state.rebuilt

    def reset_state(self) -> None:
        """Start over on a new communicator (DDP's ``_update_process_group``).

        PyTorch's ``reset_state``: a pass under way is dropped (a forward pass may follow
        a backward pass that did not finish), the divisor follows the communicator's new
        size, and the buckets are rebuilt from the next pass's ready order, rank 0's plan
        broadcast over the new group, as after construction.
        """
        self._drop_pass()
        self._set_hook(self._hook, self._serial_hooks)
        self.has_rebuilt_buckets = False
        self._rebuild_order = None

    # ----------------------------------------------------------------- join

    def shadow_backward(self, sparse_zero: Callable[[Any], Any] | None = None) -> None:
        """Enter one backward pass's reductions with zeros, on a rank with no input left.

        What a joined rank does for each iteration of the others (``join()``): every
        bucket reduced in bucket order through the same hook, from fresh zero buffers
        (its own gradients stay as they are), then the used-parameter map if one is
        summed: this rank's last summed map again, as PyTorch's joined rank sends.

        Args:
            sparse_zero: for a parameter with a sparse gradient, an empty sparse
                gradient of its shape (a sparse bucket has no buffer of its own: the
                ranks still training reduce their sparse gradients, so this rank must
                offer one too). Needed only when some parameter's gradient is sparse.

        Raises:
            ValueError: a sparse bucket and no ``sparse_zero``.
        """
        shadows, _ = build_buckets(self.plan, self.params, self.ops, self.keys, self.sparse)
        for shadow in shadows:
            if shadow.sparse:
                index = shadow.indices[0]
                if sparse_zero is None:
                    raise ValueError(
                        f"shadow_backward: parameter {self.names[index]} (index {index}) "
                        "has a sparse gradient; pass sparse_zero to make its empty one"
                    )
                shadow.flat = sparse_zero(self.params[index])
        search = {"find_unused": self.find_unused_parameters, "static_graph": self.static_graph}
        if self._skip_agreed:  # the used map first, as the training ranks sum it
            found = self._unused.on_every_rank(
                self.comm, self.ops, self.params[0], **search, used_nothing=True, keep=True
            )
        else:
            found = set()
        launched = [s for s in shadows if not (found and set(s.indices) <= found)]
        real, self._buckets = self._buckets, shadows
        try:
            for shadow in launched:
                self._launch(shadow)
            for shadow in launched:
                shadow.wait(self.clock)
        finally:
            self._buckets = real
        # The used-parameter map, when the training ranks sum one (not after a static
        # graph's first iteration): this rank used nothing, it sends its last sum again.
        self._unused.on_every_rank(self.comm, self.ops, self.params[0], **search, used_nothing=True)

    def needs_rebuild_order(self) -> bool:
        """Whether a rebuild is still to come and this rank has no ready order for it."""
        return not self.has_rebuilt_buckets and self._rebuild_order is None

    def offer_rebuild_order(self, order: Iterable[int] | Sequence[int]) -> None:
        """Use ``order`` for the one rebuild (a joined rank that never finished a pass)."""
        self._rebuild_order = list(order)
