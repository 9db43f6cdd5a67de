"""DDP's Reducer as a backend-neutral state machine, written against the Comm protocol.

It owns the bucket buffers, counts the gradients each bucket awaits, launches buckets in
bucket order (the same on every rank, so collectives match) and writes averages back at
the end of the backward pass, touching arrays only through :class:`ArrayOps` and the
group only through :class:`~xgrad.backend.Comm`. Semantics: PyTorch's ``reducer.cpp``.
This module holds the construction and the preparation of each pass; the per-gradient
marks, the launches, the end of the pass, recovery and join, and the late setup are mixed
in from ``reducer_marks``, ``reducer_launch``, ``reducer_finalize``, ``reducer_recovery``
and ``reducer_setup``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic

from xgrad.backend import Comm
from xgrad.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    BucketPlan,
)
from xgrad.reducer_buckets import build_buckets
from xgrad.reducer_finalize import EndOfPass
from xgrad.reducer_inspect import Inspection
from xgrad.reducer_launch import BucketLaunches
from xgrad.reducer_marks import GradientMarks
from xgrad.reducer_recovery import JoinAndRecovery
from xgrad.reducer_setup import LateSetup
from xgrad.reducer_static import HookCounts
from xgrad.reducer_types import A, Lender
from xgrad.reducer_types import ArrayOps as ArrayOps
from xgrad.reducer_types import GradBucket as GradBucket
from xgrad.reducer_types import Hook as Hook
from xgrad.reducer_types import IterationRecord as IterationRecord
from xgrad.reducer_unused import UnusedParams

#: per-iteration records kept (the newest).
RECORDS_KEPT = 64


class Reducer(
    GradientMarks, BucketLaunches, EndOfPass, JoinAndRecovery, LateSetup, Inspection, Generic[A]
):
    """Buckets gradients as they become ready and reduces them over a :class:`Comm`.

    Args:
        params: the parameters, in a fixed order shared by every rank (indices refer to it).
        plan: the bucket plan to start with, in launch order.
        comm: the process group.
        ops: array operations for the parameters' array library.
        names: parameter names for error messages (default ``param[i]``).
        set_grad: writes parameter ``i``'s reduced gradient back. It receives a view into
            the bucket; it must copy unless ``gradient_as_bucket_view`` is on, in which
            case the view is the gradient from then on.
        find_unused_parameters: some parameters may get no gradient (the caller passes
            them to :meth:`prepare_for_backward`).
        static_graph: the same parameters are used (and unused) in every iteration (the
            first finds them and reduces at its end).
        gradient_as_bucket_view: gradients are views into the buckets (no copy back).
        hook: a communication hook with its state bound; default: allreduce of the
            pre-divided gradients (PyTorch's default arithmetic, bit for bit).
        serial_hooks: finish bucket ``b``'s hook before ``b + 1``'s starts (PowerSGD on
            gloo, whose callbacks issue collectives in completion order).
        rebuild: rebuild the buckets once, from the first observed ready order (DDP's
            default); off for a plan that must be used as given.
        rebuild_limits: bucket caps in bytes for the rebuild (the last one repeats).
        sparse: per parameter, whether its gradient is sparse (a bucket of its own).
        skip_all_reduce_unused_params, batched_grad_copy: PyTorch's options (no reduction
            for a bucket unused on this rank; one division per bucket after the copies).
        nbytes, keys: per-parameter byte sizes and bucket keys; default from ``ops``.
        clock: the records' time source (the reference backend's is virtual).
        lender: lends bucket views out as gradients instead of ``set_grad`` copies.
        set_grads: ``set_grad`` for a whole bucket at once (indices, views), used where
            nothing in the bucket is lent or skipped.
        get_grad: a parameter's current gradient (or None). A parameter unused in a pass
            contributes it to its bucket, as DDP copies ``.grad`` in (the gradient that
            ``no_sync`` passes accumulated); without it, a zero.
    """

    def __init__(
        self,
        params: Sequence[A],
        plan: BucketPlan,
        comm: Comm,
        ops: ArrayOps[A],
        *,
        set_grad: Callable[[int, A], None],
        names: Sequence[str] | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        hook: Hook | None = None,
        serial_hooks: bool = False,
        rebuild: bool = True,
        rebuild_limits: Sequence[int] = (DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES),
        sparse: Sequence[bool] | None = None,
        skip_all_reduce_unused_params: bool = False,
        batched_grad_copy: bool = False,
        nbytes: Sequence[int] | None = None,
        keys: Sequence[Hashable] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        lender: Lender[A] | None = None,
        set_grads: Callable[[Sequence[int], Sequence[A]], None] | None = None,
        get_grad: Callable[[int], A | None] | None = None,
    ) -> None:
        self.params = list(params)
        self.get_grad = get_grad
        self.lender = None if gradient_as_bucket_view else lender
        n = len(self.params)
        if plan.num_params != n:
            raise ValueError(f"the plan covers {plan.num_params} parameters, the model has {n}")
        self.names = list(names) if names is not None else [f"param[{i}]" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"got {len(self.names)} names for {n} parameters")
        self.comm = comm
        self.ops = ops
        self.set_grad = set_grad
        self.set_grads = set_grads
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._set_hook(hook, serial_hooks)
        self.rebuild = rebuild
        self.rebuild_limits = tuple(rebuild_limits)
        self.sparse = list(sparse) if sparse is not None else [False] * n
        if len(self.sparse) != n:
            raise ValueError(f"got {len(self.sparse)} sparse flags for {n} parameters")
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.nbytes = list(nbytes) if nbytes is not None else [ops.nbytes(p) for p in self.params]
        self.keys = list(keys) if keys is not None else [ops.key(p) for p in self.params]
        self.clock = clock
        self.records: deque[IterationRecord] = deque(maxlen=RECORDS_KEPT)
        self.num_iterations = 0
        self.has_rebuilt_buckets = False
        # Per-iteration state.
        self._expect_hooks = False
        self._require_finalize = False
        self._ready = bytearray(n)
        self._unused = UnusedParams(n)
        self._counts = HookCounts(n)
        self._marked_unused = False
        self._ready_order: list[int] = []
        self._ready_times: list[float] = []
        self._backward_start = 0.0
        self._next_bucket = 0
        #: the index :meth:`mark_many` was marking (names a gradient that raised).
        self.marking = 0
        # The first complete ready order, kept for the one rebuild.
        self._rebuild_order: list[int] | None = None
        self._set_plan(plan)
        #: the plan the reducer started with (``plan`` changes at the rebuild).
        self.initial_plan = plan

    # --- plan and buffers

    def _set_plan(self, plan: BucketPlan) -> None:
        self._buckets, self._locate = build_buckets(
            plan, self.params, self.ops, self.keys, self.sparse
        )
        self.plan = plan
        self._plan_digest = plan.digest()

    # --- iteration control

    def _missing(self) -> list[int]:
        return [i for i in range(len(self.params)) if not self._ready[i]]

    def _ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
            return
        raise self.prior_reduction_error()

    def check_finalized(self) -> None:
        """Raise DDP's "Expected to have finished reduction" error if the last pass that
        expected gradients is still waiting for some (PyTorch's ``check_finalized``)."""
        self._ensure_prior_reduction_finished()

    def prepare_for_backward(
        self, unused: Iterable[int] = (), *, divisor: int | None = None
    ) -> None:
        """Expect gradient hooks: call at the end of a forward pass that will be synced.

        Args:
            unused: parameters that took no part in producing the outputs (found by
                walking the graph from them). They are marked ready at the first gradient
                hook, not now, so a forward pass whose output is dropped leaves nothing
                half-reduced behind.
            divisor: instead of the world size (ranks still training, join).
        """
        self._ensure_prior_reduction_finished()
        self._divisor = divisor or self.comm.size
        self._scale = None if self._hook else 1.0 / self._divisor
        # Large gradients copied in as they arrive, with the scale of fill_bucket's copy.
        self._early = (
            None if self.gradient_as_bucket_view or self.batched_grad_copy else self._scale
        )
        unused = sorted(set(unused))
        for i in unused:
            if not 0 <= i < len(self.params):
                raise ValueError(f"unused parameter index {i} is not in 0..{len(self.params) - 1}")
        if unused and not (self.find_unused_parameters or self.static_graph):
            raise ValueError(
                "prepare_for_backward got unused parameters "
                f"{[self.names[i] for i in unused]} but find_unused_parameters is off"
            )
        self._unused.prepare(unused, self.static_graph)
        self._counts.start()
        self._expect_hooks = True
        self._marked_unused = False
        self._ready = bytearray(len(self.params))
        self._ready_order = []
        self._ready_times = []
        self._next_bucket = 0
        for bucket in self._buckets:
            bucket.reset()

    @property
    def _delay_launch(self) -> bool:
        """The first static-graph iteration reduces everything at its end (DDP's delay)."""
        return self.static_graph and self._unused.static is None
