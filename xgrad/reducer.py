"""DDP's Reducer as a backend-neutral state machine, written against the Comm protocol.

The reducer owns the flat bucket buffers, counts how many gradients each bucket still
waits for, launches buckets strictly in bucket order (the same on every rank, so the
collectives match up), and writes averaged gradients back when the backward pass ends.
It touches arrays only through :class:`ArrayOps` and the process group only through
:class:`~xgrad.backend.Comm`, so numpy ranks in one process and torch ranks on c10d run
the same code. The semantics follow PyTorch's ``reducer.cpp``; where they differ it is
said at the method.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic

import numpy as np

from xgrad.backend import Comm
from xgrad.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    BucketPlan,
    rebuild_plan,
)
from xgrad.reducer_buckets import BucketState, build_buckets
from xgrad.reducer_errors import (
    buckets_never_reduced,
    marked_ready_twice,
    prior_reduction_unfinished,
)
from xgrad.reducer_types import A
from xgrad.reducer_types import ArrayOps as ArrayOps
from xgrad.reducer_types import GradBucket as GradBucket
from xgrad.reducer_types import Hook as Hook
from xgrad.reducer_types import IterationRecord as IterationRecord

#: how many per-iteration records a reducer keeps (the newest).
RECORDS_KEPT = 64


class Reducer(Generic[A]):
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
        find_unused_parameters: expect that some parameters get no gradient; the caller
            passes them to :meth:`prepare_for_backward`.
        static_graph: the same parameters are used (and unused) in every iteration: the
            first iteration finds them and reduces at its end; later ones mark the unused
            ones ready at the first gradient hook.
        gradient_as_bucket_view: gradients are views into the buckets (no copy back).
        hook: a communication hook with its state bound; default: allreduce of the
            pre-divided gradients (PyTorch's default arithmetic, bit for bit).
        serial_hooks: finish bucket ``b``'s hook before starting bucket ``b + 1``'s. Needed
            where a hook issues collectives from its futures' callbacks (PowerSGD) and
            those callbacks run on the comm's threads in completion order (gloo): the
            ranks would otherwise issue collectives in different orders and hang.
        rebuild_limits: (first bucket cap, bucket cap) in bytes for the rebuild.
        nbytes, keys: per-parameter byte sizes and bucket keys; default from ``ops``.
        clock: the time source of the records (the reference backend passes a virtual one).
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
        rebuild_limits: tuple[int, int] = (DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES),
        nbytes: Sequence[int] | None = None,
        keys: Sequence[Hashable] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.params = list(params)
        n = len(self.params)
        if plan.num_params != n:
            raise ValueError(f"the plan covers {plan.num_params} parameters, the model has {n}")
        self.names = list(names) if names is not None else [f"param[{i}]" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"got {len(self.names)} names for {n} parameters")
        self.comm = comm
        self.ops = ops
        self.set_grad = set_grad
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.hook = hook  # through the property: also sets the pre-division scale
        self.serial_hooks = serial_hooks
        self.rebuild_limits = rebuild_limits
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
        self._unused: list[int] = []
        self._marked_unused = False
        self._ready_order: list[int] = []
        self._ready_times: list[float] = []
        self._backward_start = 0.0
        self._next_bucket = 0
        self._static_unused: list[int] | None = None
        self._static_global_unused: set[int] | None = None
        # The first complete ready order, kept for the one rebuild.
        self._rebuild_order: list[int] | None = None
        self._set_plan(plan)

    # ----------------------------------------------------------------- plan and buffers

    def _set_plan(self, plan: BucketPlan) -> None:
        self._buckets, self._locate = build_buckets(plan, self.params, self.ops, self.keys)
        self.plan = plan

    def bucket_views(self) -> list[Any]:
        """Per parameter, its view into the bucket buffers (for ``gradient_as_bucket_view``)."""
        return [bucket.in_views[k] for bucket, k in self._locate]

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [sum(self.nbytes[i] for i in b) for b in self.plan.buckets]

    # ----------------------------------------------------------------- iteration control

    def _missing(self) -> list[int]:
        return [i for i in range(len(self.params)) if not self._ready[i]]

    def _ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
            return
        raise prior_reduction_unfinished(self._missing(), self.names, self.comm.rank)

    def rebuild_buckets(self) -> bool:
        """Rebuild the buckets once from the first observed ready order (call in forward).

        As in DDP, this happens only when the plan can be trusted to repeat: without
        ``find_unused_parameters`` or with ``static_graph``. Every rank computes the plan
        from its own order and then adopts rank 0's, so all ranks launch the same buckets.

        Returns:
            True when the buckets were rebuilt (gradient views must then be re-taken).
        """
        self._ensure_prior_reduction_finished()
        if self.has_rebuilt_buckets or self._rebuild_order is None:
            return False
        if self.find_unused_parameters and not self.static_graph:
            return False
        first, cap = self.rebuild_limits
        local = rebuild_plan(
            self.nbytes,
            self._rebuild_order,
            keys=self.keys,
            bucket_cap_bytes=cap,
            first_bucket_cap_bytes=first,
        )
        plan = BucketPlan.from_json(self.comm.broadcast_object(local.to_json(), src=0))
        self._set_plan(plan)
        self.has_rebuilt_buckets = True
        self._rebuild_order = None
        return True

    def prepare_for_backward(self, unused: Iterable[int] = ()) -> None:
        """Expect gradient hooks: call at the end of a forward pass that will be synced.

        Args:
            unused: parameters that took no part in producing the outputs (found by
                walking the graph from them). They are marked ready at the first gradient
                hook, not now, so a forward pass whose output is dropped leaves nothing
                half-reduced behind.
        """
        self._ensure_prior_reduction_finished()
        unused = sorted(set(unused))
        for i in unused:
            if not 0 <= i < len(self.params):
                raise ValueError(f"unused parameter index {i} is not in 0..{len(self.params) - 1}")
        if unused and not (self.find_unused_parameters or self.static_graph):
            raise ValueError(
                "prepare_for_backward got unused parameters "
                f"{[self.names[i] for i in unused]} but find_unused_parameters is off"
            )
        if self.static_graph and self._static_unused is not None:
            unused = self._static_unused
        self._unused = unused
        self._expect_hooks = True
        self._marked_unused = False
        self._ready = bytearray(len(self.params))
        self._ready_order = []
        self._ready_times = []
        self._next_bucket = 0
        for bucket in self._buckets:
            bucket.pending = len(bucket.indices)
            bucket.work = None
            bucket.result = None
            bucket.waited = False

    @property
    def hook(self) -> Hook | None:
        """The communication hook (``None``: DDP's default pre-divided allreduce)."""
        return self._hook

    @hook.setter
    def hook(self, hook: Hook | None) -> None:
        self._hook = hook
        # Without a hook the reducer pre-divides while copying; a hook divides itself.
        self._scale = 1.0 / self.comm.size if hook is None else None

    @property
    def _delay_launch(self) -> bool:
        """The first static-graph iteration reduces everything at its end (DDP's delay)."""
        return self.static_graph and self._static_unused is None

    def mark_ready(self, index: int, grad: Any) -> None:
        """A parameter's gradient is complete (call from its post-accumulate hook).

        ``grad`` is the accumulated gradient, so gradients accumulated under ``no_sync``
        are reduced with this one. Does nothing when no synced backward is expected.
        """
        if not self._expect_hooks:
            return
        now = self.clock()
        if not self._marked_unused:
            self._marked_unused = True
            self._backward_start = now
            for i in self._unused:
                self._mark(i, None, now)
        self._mark(index, grad, now)

    def _mark(self, index: int, grad: Any, now: float) -> None:
        if self._ready[index]:
            raise marked_ready_twice(index, self.names, self.comm.rank)
        self._ready[index] = 1
        self._ready_order.append(index)
        self._ready_times.append(now)
        self._require_finalize = True
        bucket, k = self._locate[index]
        view = bucket.in_views[k]
        ops = self.ops
        if grad is None:
            ops.zero_(view)
        elif self.gradient_as_bucket_view and ops.is_view_of(grad, view):
            # Autograd accumulated straight into the bucket: only the division is left.
            if self._scale is not None:
                ops.div_(view, self.comm.size)
        else:
            ops.copy_to(view, grad, self._scale)
        bucket.pending -= 1
        if bucket.pending == 0 and not self._delay_launch:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch buckets in bucket order: a ready bucket waits for all before it."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: BucketState) -> None:
        if self.serial_hooks and self.hook is not None and bucket.index > 0:
            self._buckets[bucket.index - 1].wait(self.clock)
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

    def finalize(self) -> None:
        """End of the backward pass: wait for every bucket and write gradients back.

        Unlike DDP, which notices only at the next iteration, a backward pass that ended
        with parameters still waiting for a gradient raises here (and again at the next
        forward, as DDP does), so no step is ever taken on half-reduced gradients.
        Parameters no rank used keep their gradient untouched, as in DDP.
        """
        if not self._expect_hooks:
            return
        if not self._marked_unused:
            # No hook fired: nothing to reduce (e.g. the loss did not depend on the params).
            self._expect_hooks = False
            return
        if self._delay_launch:
            # DDP's delayed allreduce: the first static-graph iteration learns which
            # parameters are unused, then reduces every bucket at once.
            self._static_unused = self._missing()
            for i in self._static_unused:
                self._mark(i, None, self.clock())
            self._launch_ready_buckets()
        if self._next_bucket < len(self._buckets):
            raise buckets_never_reduced(self._missing(), self.names, self.comm.rank)
        globally_unused = self._globally_unused()
        for bucket in self._buckets:
            result = bucket.wait(self.clock)
            if result is not None and not self.ops.is_view_of(result, bucket.flat):
                self.ops.copy_to(bucket.flat, result)
            for k, i in enumerate(bucket.indices):
                if i not in globally_unused:
                    self.set_grad(i, bucket.in_views[k])
        end = self.clock()
        if self._rebuild_order is None and not self.has_rebuilt_buckets:
            self._rebuild_order = list(self._ready_order)
        self.records.append(
            IterationRecord(
                iteration=self.num_iterations,
                plan_digest=self.plan.digest(),
                ready_order=tuple(self._ready_order),
                ready_times=tuple(self._ready_times),
                launch_times=tuple(b.launched_at for b in self._buckets),
                finish_times=tuple(b.finished_at for b in self._buckets),
                backward_start=self._backward_start,
                backward_end=end,
                unused=tuple(self._unused if self._static_unused is None else self._static_unused),
            )
        )
        self.num_iterations += 1
        self._expect_hooks = False
        self._require_finalize = False

    def _globally_unused(self) -> set[int]:
        """Parameters that no rank used this iteration (their grads stay untouched).

        Only searched when parameters may be unused; then the per-rank used maps are
        summed with one extra allreduce, as DDP does.
        """
        if self.static_graph and self._static_global_unused is not None:
            return self._static_global_unused
        if not (self.find_unused_parameters or self.static_graph):
            return set()
        locally_unused = self._unused if self._static_unused is None else self._static_unused
        used = np.ones(len(self.params), dtype=np.int32)
        used[list(locally_unused)] = 0
        like = self._buckets[0].flat
        total = self.ops.to_numpy(self.comm.allreduce(self.ops.from_numpy(used, like)).wait())
        found = {int(i) for i in np.flatnonzero(total == 0)}
        if self.static_graph:
            self._static_global_unused = found
        return found
