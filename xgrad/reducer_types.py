"""What the reducer exchanges with the rest of xgrad: array operations, hook buckets, records.

Split from the state machine in :mod:`xgrad.reducer` so that backends, hooks and
statistics can name these types without the reducer's internals; the reducer module
re-exports them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from xgrad.backend import Work

#: the array type of one array library (``numpy.ndarray``, ``torch.Tensor``...): what the
#: parameters, gradients and bucket buffers of one reducer are.
A = TypeVar("A")


class ArrayOps(Protocol[A]):
    """The few array operations the reducer needs, for one array library's arrays ``A``."""

    def numel(self, x: A) -> int: ...

    def nbytes(self, x: A) -> int: ...

    def key(self, x: A) -> Hashable:
        """What must not be mixed in a bucket (dtype and device)."""
        ...

    def new_flat(self, like: Sequence[A], numel: int) -> A:
        """A zeroed 1-D buffer of ``numel`` elements with ``like[0]``'s dtype and device."""
        ...

    def copy_to(self, out: A, x: A, scale: float | None = None) -> None:
        """``out[...] = x * scale`` (no multiply when ``None``); ``out`` is a bucket view.

        The scaled copy is PyTorch's pre-division (``mul_out`` by ``1/world_size``): it
        must round exactly as that does for results to agree bit for bit.
        """
        ...

    def copy_all(self, outs: Sequence[A], xs: Sequence[A], scale: float | None) -> None:
        """:meth:`copy_to` for many pairs at once (a bucket's gradients, one batched call)."""
        ...

    def view(self, flat: A, offset: int, like: A) -> A:
        """A view of ``flat`` from ``offset`` shaped like ``like`` (writes go to ``flat``)."""
        ...

    def div_(self, x: A, divisor: int) -> None:
        """Divide in place."""
        ...

    def clone(self, x: A) -> A:
        """A copy of ``x`` that shares no memory with anything (a sparse gradient's values
        may be another's: one upstream gradient into two ``sparse=True`` embeddings)."""
        ...

    def div_all(self, xs: Sequence[A], divisor: int) -> None:
        """:meth:`div_` for many arrays at once."""
        ...

    def zero_(self, x: A) -> None: ...

    def is_view_of(self, x: A, view: A) -> bool:
        """Whether ``x`` already is (aliases the memory of) ``view``."""
        ...

    def dtype_mismatch(self, flat: A, xs: Sequence[A]) -> tuple[int, str, str] | None:
        """The first ``xs[k]`` whose dtype is not bucket buffer ``flat``'s, as ``(k, its
        dtype, the buffer's dtype)``; ``None`` when all match. ``xs`` are gradients about
        to be copied into the bucket (or its views): a copy would round one of another
        dtype to the bucket's without a word (a module converted after its DDP was made).
        Called once per bucket, on the per-gradient path: keep it cheap."""
        ...

    def from_numpy(self, a: np.ndarray, like: A) -> A:
        """``a`` as this library's array, on ``like``'s device."""
        ...

    def to_numpy(self, x: A) -> np.ndarray: ...


#: an array a lender takes (contravariant: a protocol's argument type).
A_in = TypeVar("A_in", contravariant=True)


class Lender(Protocol[A_in]):
    """Hands bucket views out as gradients instead of copying them back (optional).

    Lending saves the copy out of the bucket after the reduction; the reducer then
    must not write into a lent view while anyone but itself can still see it, so it
    asks :meth:`free` before filling the bucket again, and fills a fresh buffer when not.
    """

    @property
    def lendable(self) -> Sequence[bool]:
        """Per parameter, whether its gradient may be lent (large, laid out as its view)."""
        ...

    def lend(self, index: int, view: A_in) -> bool:
        """Make ``view`` parameter ``index``'s gradient if nothing else sees the old one.

        Returns False when the gradient must be written back as usual instead.
        """
        ...

    def lend_many(self, indices: Sequence[int], views: Sequence[A_in]) -> list[bool]:
        """:meth:`lend` for each ``indices[k]`` and ``views[k]``, in one call."""
        ...

    def free(self, flat: A_in, views: Sequence[A_in], lent: Sequence[int]) -> bool:
        """Whether no one but the reducer holds ``flat`` or the lent ``views`` any more."""
        ...


class GradBucket(Generic[A]):
    """A bucket as a communication hook sees it: PyTorch ``GradBucket``'s methods.

    PyTorch's own hooks (``allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook``)
    call only these methods, so they run unchanged on an xgrad bucket of torch tensors.
    """

    def __init__(
        self,
        index: int,
        buffer: A,
        gradients: list[A],
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

    def buffer(self) -> A:
        return self._buffer

    def gradients(self) -> list[A]:
        return self._gradients

    def parameters(self) -> list[Any]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: A) -> None:
        """Replace the flat buffer; :meth:`gradients` become row-major views of the new one.

        PyTorch's ``GradBucket`` slices its gradients from the current buffer, so a hook
        that swaps the buffer and calls another (``fp16_compress_wrapper(powerSGD_hook)``)
        hands it the gradients in the new buffer's dtype. A buffer of another length (a
        compressed one) leaves them as they were.
        """
        grads: list[Any] = self._gradients
        flat: Any = buffer
        if all(g is not None for g in grads):
            sizes = [math.prod(g.shape) for g in grads]
            if sum(sizes) == math.prod(flat.shape):
                starts = itertools.accumulate(sizes, initial=0)
                self._gradients = [
                    flat[start : start + size].reshape(g.shape)
                    for g, start, size in zip(grads, starts, sizes, strict=False)
                ]
        self._buffer = buffer


#: A communication hook with its state already bound: bucket in, in-flight reduction out.
Hook = Callable[[GradBucket[Any]], Work]


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

    @classmethod
    def of(
        cls,
        iteration: int,
        plan_digest: str,
        ready_order: Sequence[int],
        ready_times: Sequence[float],
        buckets: Sequence[Any],
        span: tuple[float, float],
        unused: Sequence[int],
    ) -> IterationRecord:
        """The record of a finished pass (``buckets``: the reducer's, with their times)."""
        return cls(
            iteration=iteration,
            plan_digest=plan_digest,
            ready_order=tuple(ready_order),
            ready_times=tuple(ready_times),
            launch_times=tuple(b.launched_at for b in buckets),
            finish_times=tuple(b.finished_at for b in buckets),
            backward_start=span[0],
            backward_end=span[1],
            unused=tuple(unused),
        )

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
