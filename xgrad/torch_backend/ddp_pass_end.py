"""The end of a backward pass of the DDP's gradient hooks: the reduction finalized.

Kept apart from the hooks themselves (:mod:`.ddp_hooks`, whose class mixes this in): the
hooks feed the reducer as gradients arrive and queue the end of the pass on the autograd
engine; this is what runs there (:meth:`PassEnd._finalize`, :meth:`PassEnd._nosync_done`),
and what a pass that left buckets unreduced or failed leaves for the next forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xgrad.failure import RankError, error_for
from xgrad.raising import raise_from
from xgrad.reducer import Reducer
from xgrad.reducer_errors import GradientDtypeError
from xgrad.torch_backend.ddp_arrivals import ArrivalLog
from xgrad.torch_backend.ddp_cut_short import put_off
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_stats import IterationTimes
from xgrad.torch_backend.ddp_unfinished import UNFINISHED
from xgrad.torch_backend.ddp_writeback import GradientWriteBack

__all__ = ["UNREDUCED", "PassEnd", "peer_unreduced"]

#: where a pass that left buckets unreduced is posted (its peers recognise it there).
UNREDUCED = "backward (parameters without a gradient)"


def peer_unreduced(exc: Exception) -> bool:
    """Whether ``exc`` is a peer's pass that left buckets unreduced, posted as this
    rank waited for them."""
    return isinstance(exc, RankError) and exc.failure.where == UNREDUCED


class PassEnd(GradientWriteBack):
    """Mixed into :class:`~xgrad.torch_backend.ddp_hooks.GradientHooks`; uses its state."""

    params: list[nn.Parameter]
    reducer: Reducer | None
    watch: StepWatch
    arrivals: ArrivalLog
    finalize_queued: bool
    unsynced: bool
    nosync_open: bool
    cut_short: str | None
    unfinished: RuntimeError | None
    after_backward: Callable[[], None] | None
    buffer_futures: list[Any]
    backward_started: float
    forward_seconds: float
    forward_started: float
    timeline: deque[IterationTimes]
    log_error: Callable[[BaseException], None]
    _copy_dst: list[torch.Tensor]
    _copy_src: list[torch.Tensor]

    drain: Callable[[], None]

    def _nosync_done(self) -> None:
        if put_off(self, self._nosync_done, complete=False):
            return
        self.nosync_open = False
        UNFINISHED.discard(self)
        self.cut_short = None  # (noted by another thread's pass that raised)

    def _finalize(self) -> None:
        reducer = self.reducer
        assert reducer is not None
        if self.arrivals.log:
            self.drain()
        if put_off(self, self._finalize, self.unfinished is not None or reducer.all_ready()):
            return
        self.finalize_queued = False
        UNFINISHED.discard(self)
        self.cut_short = None  # (noted by another thread's pass that raised)
        done = reducer.num_iterations
        try:
            if self.unfinished is None:  # (a hook may have ended the pass already)
                reducer.finalize()
                self.wait_buffer_futures()
                if self.arrivals.enabled and reducer.num_iterations > done:
                    record = reducer.records[-1]
                    self.arrivals.relayout(record.ready_order, record.unused, reducer.plan)
                if self._copy_dst:
                    # One fused copy for every gradient instead of one call per parameter.
                    torch._foreach_copy_(self._copy_dst, self._copy_src)
        except Exception as exc:
            # A gradient refused at its copy (a static graph's first pass copies them
            # here) fails the pass as it would in its hook, not as one left unreduced.
            unreduced = not reducer.all_ready() and not isinstance(exc, GradientDtypeError)
            if not ((unreduced or peer_unreduced(exc)) and self._defer(exc)):
                raise_from(self._fail("reduction", exc), exc)
        finally:
            self._copy_dst.clear()
            self._copy_src.clear()
            if self.after_backward is not None:
                self.after_backward()
        if self.unfinished is not None:
            if self.unsynced:
                # A no_sync pass (the reducer still prepared by a forward pass every rank
                # left without backward) whose parameters differ from that pass's: its
                # gradients are this rank's own, as no_sync gives them, and are left as
                # PyTorch leaves them (pre-divided in their bucket views under
                # gradient_as_bucket_view): the next forward pass raises before any step.
                reducer.leave_in_views()
                return
            # The pass's gradients are dropped: each rank's own, partly reduced. PyTorch
            # leaves them, and an optimizer step before the next forward pass (which
            # raises) makes replicas that differ for good; with none, it changes nothing.
            for p in self.params:
                p.grad = None
            return
        end = time.perf_counter()
        self.timeline.append(
            IterationTimes.of(
                reducer.records[-1],
                self.forward_seconds,
                end - self.backward_started,
                self.forward_started,
            )
        )

    def _defer(self, exc: Exception) -> bool:
        """A pass that left buckets unreduced (gradients never came) ends here as in
        PyTorch, whose next forward pass raises its "prior iteration" error; this one's
        raises it too (:attr:`unfinished`), and the pass after starts clean on every rank.

        Posted first, so that the peers, which wait for buckets this rank will not launch,
        stop now instead of at the timeout; they end their pass the same way and raise
        this rank's error at their next forward pass, so every rank's loop stays in step.

        Returns False, deferring nothing, where the step's first failure is a peer's raise
        (a comm hook's, a hook's): that peer raised in this pass and begins the next step
        clean, so this rank fails the pass now too (the caller raises). Deferred, its next
        step began one pass after the peer's, and every later step was averaged with the
        peer's step before it, without a word.
        """
        assert self.reducer is not None
        if isinstance(exc, RankError):
            first = exc.failure
        else:
            first = self.watch.post(UNREDUCED, exc).failure
        if first.kind == "error" and first.where != UNREDUCED:
            return False
        if isinstance(exc, RankError):  # a peer's: the error it will raise too, here
            self.reducer.fail(str(exc))
            self.unfinished = error_for(exc.failure, self.watch.channel.rank, also=exc.also)
        else:
            self.unfinished = self.reducer.prior_reduction_error()
        return True

    def wait_buffer_futures(self) -> None:
        """Wait for the buffer comm hook's futures (each bounded and watched), then drop them."""
        pending, self.buffer_futures = self.buffer_futures, []
        for future in pending:
            future.wait()

    def _fail(self, where: str, exc: Exception) -> RankError:
        """Post this rank's failure and fail the reducer's pass; the error to raise.

        Made here, not in the ``except`` block that raises it: a local there would hold
        the error on its own traceback (see :mod:`xgrad.raising`).
        """
        assert self.reducer is not None
        error = self.watch.post(where, exc)
        self.reducer.fail(str(error))
        self.log_error(error)
        return error
