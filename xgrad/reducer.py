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
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from xgrad.backend import Comm, Work
from xgrad.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    BucketPlan,
    rebuild_plan,
)

#: how many per-iteration records a reducer keeps (the newest).
RECORDS_KEPT = 64


class ArrayOps(Protocol):
    """The few array operations the reducer needs, for one array library."""

    def numel(self, x: Any) -> int: ...

    def nbytes(self, x: Any) -> int: ...

    def key(self, x: Any) -> Hashable:
        """What must not be mixed in a bucket (dtype and device)."""
        ...

    def new_flat(self, like: Sequence[Any], numel: int) -> Any:
        """A zeroed 1-D buffer of ``numel`` elements with ``like[0]``'s dtype and device."""
        ...

    def copy_to(self, out: Any, x: Any, scale: float | None = None) -> None:
        """``out[...] = x * scale`` (no multiply when ``None``); ``out`` is a bucket view.

        The scaled copy is PyTorch's pre-division (``mul_out`` by ``1/world_size``): it
        must round exactly as that does for results to agree bit for bit.
        """
        ...

    def view(self, flat: Any, offset: int, like: Any) -> Any:
        """A view of ``flat`` from ``offset`` shaped like ``like`` (writes go to ``flat``)."""
        ...

    def div_(self, x: Any, divisor: int) -> None:
        """Divide in place."""
        ...

    def zero_(self, x: Any) -> None: ...

    def is_view_of(self, x: Any, view: Any) -> bool:
        """Whether ``x`` already is (aliases the memory of) ``view``."""
        ...

    def from_numpy(self, a: np.ndarray, like: Any) -> Any:
        """``a`` as this library's array, on ``like``'s device."""
        ...

    def to_numpy(self, x: Any) -> np.ndarray: ...


class GradBucket:
    """A bucket as a communication hook sees it: PyTorch ``GradBucket``'s methods.

    PyTorch's own hooks (``allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook``)
    call only these methods, so they run unchanged on an xgrad bucket of torch tensors.
    """

    def __init__(
        self,
        index: int,
        buffer: Any,
        gradients: list[Any],
        parameters: list[Any],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        return self._buffer

    def gradients(self) -> list[Any]:
        return self._gradients

    def parameters(self) -> list[Any]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: Any) -> None:
        self._buffer = buffer


#: A communication hook with its state already bound: bucket in, in-flight reduction out.
Hook = Callable[[GradBucket], Work]


@dataclass(frozen=True)
class IterationRecord:
    """What happened in one synchronised backward pass (times from the reducer's clock).

    Attributes:
        iteration: 0-based count of synchronised backward passes.
        plan_digest: digest of the plan the iteration ran with.
        ready_order: parameter indices in the order their gradients became ready
            (unused parameters marked ready by the reducer included, after the hook
            that marked them).
        ready_times: per entry of ``ready_order``, when it became ready.
        launch_times: per bucket, when its reduction was launched.
        finish_times: per bucket, when its reduction was seen finished.
        backward_start: the first gradient hook of the pass.
        backward_end: when the last gradient was written back.
        unused: parameters marked ready without a gradient on this rank.
    """

    iteration: int
    plan_digest: str
    ready_order: tuple[int, ...]
    ready_times: tuple[float, ...]
    launch_times: tuple[float, ...]
    finish_times: tuple[float, ...]
    backward_start: float
    backward_end: float
    unused: tuple[int, ...]

    @property
    def compute_seconds(self) -> float:
        """From the first gradient hook to the last gradient becoming ready."""
        return (self.ready_times[-1] if self.ready_times else self.backward_start) - (
            self.backward_start
        )

    @property
    def communication_seconds(self) -> float:
        """From the first launch to the last observed finish."""
        if not self.launch_times:
            return 0.0
        return max(self.finish_times) - min(self.launch_times)

    @property
    def overlap_seconds(self) -> float:
        """Communication that ran while gradients were still being computed."""
        if not self.launch_times or not self.ready_times:
            return 0.0
        return max(0.0, self.ready_times[-1] - min(self.launch_times))


class _Bucket:
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


class Reducer:
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
        params: Sequence[Any],
        plan: BucketPlan,
        comm: Comm,
        ops: ArrayOps,
        *,
        set_grad: Callable[[int, Any], None],
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
        for b, members_of_b in enumerate(plan.buckets):
            mixed = {self.keys[i] for i in members_of_b}
            if len(mixed) > 1:
                raise ValueError(f"bucket {b} of the plan mixes {sorted(map(str, mixed))}")
        self.plan = plan
        self._buckets: list[_Bucket] = []
        self._locate: list[tuple[_Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for b, indices in enumerate(plan.buckets):
            members = [self.params[i] for i in indices]
            offsets: list[int] = []
            total = 0
            for p in members:
                offsets.append(total)
                total += self.ops.numel(p)
            flat = self.ops.new_flat(members, total)
            views = [self.ops.view(flat, off, p) for off, p in zip(offsets, members, strict=True)]
            bucket = _Bucket(b, indices, flat, views)
            self._buckets.append(bucket)
            for k, i in enumerate(indices):
                self._locate[i] = (bucket, k)

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
        missing = self._missing()
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a "
            "new one. This error indicates that your module has parameters that were not "
            "used in producing loss. You can enable unused parameter detection by passing "
            "the keyword argument `find_unused_parameters=True`, and by making sure all "
            "outputs of `forward` take part in calculating the loss. "
            + self._describe_missing(missing)
        )

    def _describe_missing(self, missing: list[int]) -> str:
        return (
            f"Parameter indices which did not receive grad for rank {self.comm.rank}: "
            f"{' '.join(map(str, missing))}\n"
            f"Parameters which did not receive grad for rank {self.comm.rank}: "
            f"{', '.join(self.names[i] for i in missing)}"
        )

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
            raise RuntimeError(
                "Expected to mark a variable ready only once. This error is caused by one of "
                "the following reasons: 1) Use of a module parameter outside the `forward` "
                "function, 2) Reused parameters in multiple reentrant backward passes, "
                "3) Incorrect unused parameter detection. "
                f"Parameter at index {index} with name {self.names[index]} has been marked "
                f"as ready twice on rank {self.comm.rank}."
            )
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

    def _launch(self, bucket: _Bucket) -> None:
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
            raise RuntimeError(
                "Some parameters received no gradient in this backward pass, so their "
                "buckets were never reduced. Pass find_unused_parameters=True if parts of the "
                "model are legitimately unused. " + self._describe_missing(self._missing())
            )
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
