"""The adapter between autograd and the reducer: gradient hooks in, gradients written back.

Each reduced parameter gets a post-accumulate-grad hook that hands its gradient to
:meth:`Reducer.mark_ready`; the first hook of a synchronised backward pass queues
:meth:`Reducer.finalize` on the autograd engine, so the reduction ends with the pass.
Reduced gradients come back through :meth:`GradientHooks.set_grad` (a copy, fused into
one ``_foreach_copy_``, or the bucket view itself). What runs at the end of the pass is
:mod:`.ddp_pass_end`'s. Communication hooks are registered in :mod:`.ddp_comm_hooks`; a
pass cut short part-way is dropped at the next forward pass by :mod:`.ddp_recover`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from xgrad.failure import Failure
from xgrad.raising import raise_from
from xgrad.reducer import Reducer
from xgrad.reducer_recovery import StepState
from xgrad.torch_backend import ddp_exit
from xgrad.torch_backend.ddp_arrivals import ArrivalLog
from xgrad.torch_backend.ddp_compile import refuse_compiled_autograd
from xgrad.torch_backend.ddp_cut_short import PUT_OFF, note_backward_errors
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_lend import lendable
from xgrad.torch_backend.ddp_pass_end import PassEnd, peer_unreduced
from xgrad.torch_backend.ddp_stats import TIMINGS_KEPT, IterationTimes
from xgrad.torch_backend.ddp_unfinished import DROPPED, UNFINISHED
from xgrad.torch_backend.weak_hooks import owned_by

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_which_step import GivenUp
    from xgrad.torch_backend.join_rounds import OpenRound

current_graph_task = torch._C._current_graph_task_id


class GradientHooks(PassEnd):
    """Per-parameter autograd hooks feeding a reducer, and the end-of-backward callback.

    Args:
        params: the reduced parameters, in the reducer's order.
        gradient_as_bucket_view: make each ``.grad`` its bucket view instead of copying.
        lend: lend bucket views as gradients where no one can tell (:mod:`.ddp_lend`);
            off when the buckets' dtype differs from the parameters' (mixed precision).

    Call :meth:`attach` once the reducer (which needs :meth:`set_grad`) exists. It is
    also the reducer's :class:`~xgrad.reducer_types.Lender`.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], gradient_as_bucket_view: bool, lend: bool = True
    ) -> None:
        self.params = list(params)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.lendable = [lend and lendable(p) for p in self.params]
        self.reducer: Reducer | None = None
        #: set by forward: the next gradient hook starts a synchronised backward pass.
        self.sync_pending = False
        #: under join(): the round that this backward pass's first gradient hook enters,
        #: else the next forward pass or leaving join() (:mod:`.join_rounds`).
        self.join_round: OpenRound | None = None
        #: the end-of-backward callback is queued and has not run yet.
        self.finalize_queued = False
        #: an end callback run at the end of a reentrant backward's graph task before the
        #: pass was complete (:mod:`.ddp_cut_short`): the next gradient hook queues it again.
        self.requeue: Callable[[], None] | None = None
        self.forward_seconds = 0.0
        self.forward_started = 0.0  # time.perf_counter() at the forward pass's start
        #: no_sync passes ran since the last synchronised forward pass (the first of
        #: them began the synchronised step they accumulate for).
        self.accumulating = False
        #: whether the last synchronised step began with no_sync passes (None: no step
        #: yet): under xgrad's Join, a given-up iteration stands in only for such a DDP's
        #: no_sync pass (join_given_up).
        self.accumulated: bool | None = None
        #: set by a no_sync forward: the next gradient hook starts that pass's backward.
        self.nosync_pending = False
        #: a no_sync backward pass began and its end callback has not run: at the next
        #: forward pass, one still open raised part-way (ddp_recover.start_forward).
        self.nosync_open = False
        #: the failure of the step this rank gave up in a no_sync pass, until the next
        #: pass: a synchronised one is that step's, where the peers raise it too (a
        #: no_sync one defers the question: given_up_step, below).
        self.given_up: Failure | None = None
        #: a step given up in a no_sync pass, while a no_sync pass after it waits to be
        #: placed in a step (:mod:`.ddp_which_step`).
        self.given_up_step: GivenUp | None = None
        #: under xgrad's Join, what a rank that skips a given-up step's synchronised pass
        #: sends for it (join_rounds.stand_in; set by the context): given whether to read
        #: the sum, whether a synchronised pass next is the given-up step's
        self.stand_in: Callable[[bool], bool] | None = None
        #: under xgrad's Join of several DDPs, what a step given up in a no_sync pass
        #: does to the iteration's other DDPs (join_given_up; set by the context)
        self.give_up: Callable[[Failure], None] | None = None
        #: the first joinable's forward passes when this DDP's pass of a given-up
        #: iteration was stood in for (join_given_up): that pass is refused
        self.skipped_at: int | None = None
        #: what the reducer had learned when the current step began (restored if it fails)
        self.step_state: StepState | None = None
        self.backward_started = 0.0
        self.timeline: deque[IterationTimes] = deque(maxlen=TIMINGS_KEPT)
        self.handles: list[Any] = []
        self.watch: StepWatch  # set by the DDP before the first pass
        #: run at the end of every synchronised backward pass (mixed precision's casts).
        self.after_backward: Callable[[], None] | None = None
        #: a buffer comm hook's futures, waited for at the end of the backward pass.
        self.buffer_futures: list[Any] = []
        self._copy_dst: list[torch.Tensor] = []
        self._copy_src: list[torch.Tensor] = []
        self.arrivals: ArrivalLog  # set by attach
        #: the autograd graph task of the synchronised pass under way.
        self._task = -1
        #: the thread of the last forward pass with gradients (the one its backward runs
        #: from): the backward call that notes its failure (ddp_cut_short).
        self.forward_thread = 0
        #: the pass expected is a no_sync one that the reducer, still prepared for a
        #: forward pass every rank left without backward, reduces (ddp_forward).
        self.unsynced = False
        #: PyTorch's "prior iteration" error of a pass that left buckets unreduced,
        #: raised at the next forward pass with grad enabled, as PyTorch raises it.
        self.unfinished: RuntimeError | None = None
        #: the exception (``"Type: text"``) that cut the pass under way (or no_sync) short
        #: on this rank, noted as it left autograd (:mod:`.ddp_cut_short`): what the next
        #: forward pass posts for it.
        self.cut_short: str | None = None
        self.log_error: Callable[[BaseException], None] = lambda exc: None  # the DDP's log
        #: whether the DDP is under join() now (set by the DDP: a weak reference to it)
        self.joining: Callable[[], bool] = lambda: True
        #: how many pipeline runtimes drive the DDP (a stage's): each gives a failed step
        #: up itself; back to 0 as they are collected (:func:`.pipeline_ddps.unpipelined`)
        self.pipelined = 0

    def __del__(self) -> None:
        # Collected (its DDP dropped) with a step under way on this rank: a forward pass
        # whose backward never came, or no_sync passes begun. The peers may wait in that
        # step's collectives for this rank's part: recorded, for the next forward pass or
        # DDP made here to post (not posted here: the collector runs wherever it is).
        # At the interpreter's exit (module globals cleared) there is no one to tell.
        # With none under way, where its next step is kept for the note this rank posts
        # as it leaves the group (ddp_exit).
        with contextlib.suppress(Exception):
            watch = getattr(self, "watch", None)
            if watch is None:
                return
            if self.sync_pending or self.accumulating or self.nosync_open:
                DROPPED.append(watch)
            else:
                ddp_exit.collected(watch)

    def attach(self, reducer: Reducer, log_arrivals: bool = True) -> None:
        """Register the autograd hooks that feed ``reducer``.

        ``log_arrivals``: let small parameters' hooks only log their arrival once the
        order is known (:mod:`.ddp_arrivals`); off, every hook is a Python one.
        """
        self.reducer = reducer
        note_backward_errors(self)
        ddp_exit.install()  # (what a pass leaves unfinished, posted as the process ends)
        python_hooks = [self._make_hook(i) for i in range(len(self.params))]
        self.handles = [
            p.register_post_accumulate_grad_hook(h)
            for p, h in zip(self.params, python_hooks, strict=True)
        ]
        # The hooks hold this object weakly, and leave the parameters when it is collected
        # (weak_hooks): a dropped DDP is freed, and a DDP made later on the same module
        # does not run its hooks.
        owned_by(self, self.handles)
        self.arrivals = ArrivalLog(self.params, self.handles, python_hooks)
        if not log_arrivals:
            self.arrivals.enabled = False

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        assert self.reducer is not None
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        ref = weakref.ref(self)  # not the DDP itself: see attach

        def hook(param: torch.Tensor) -> None:
            me = ref()
            if me is None:  # the DDP was dropped: its hooks are being removed
                return
            reducer = cast(Reducer, me.reducer)  # set before any hook was made
            if me.sync_pending:
                # First gradient of a synchronised backward pass: end it with finalize.
                refuse_compiled_autograd()
                me.sync_pending = False
                if me.join_round is not None:  # before any collective of the pass
                    go, me.join_round = me.join_round, None
                    go()
                me.backward_started = time.perf_counter()
                engine.queue_callback(me._finalize)
                me.finalize_queued = True
                UNFINISHED.add(me)
                if me.arrivals.enabled:
                    me._task = current_graph_task()
            elif me.nosync_pending:
                # First gradient of a no_sync backward pass: its end is watched as well,
                # and what cuts it short noted for the peers (:mod:`.ddp_cut_short`).
                me.nosync_pending = False
                me.nosync_open = True
                UNFINISHED.add(me)
                engine.queue_callback(me._nosync_done)
            elif me.requeue is not None:
                engine.queue_callback(me.requeue)  # (on this hook's graph task)
                me.requeue = None
                PUT_OFF.discard(me)
            elif me.arrivals.enabled and reducer.expecting and current_graph_task() != me._task:
                # Reentrant backward: the pass's first hook must stay a Python one.
                me.arrivals.disable()
            if RemovableHandle.next_id != me.arrivals.handles_made and not (
                me.arrivals.hooks_last(index)
            ):
                # A hook added since the forward runs after this one: the gradient is
                # marked at the next drain, once that hook has changed it.
                me.arrivals.log.append(param)
                return
            if me.arrivals.log:
                me.drain()
            try:
                reducer.mark_ready(index, param.grad)
            except Exception as exc:
                # seen waiting for a bucket (a hook's callbacks)
                if peer_unreduced(exc) and me._defer(exc):
                    return
                raise_from(me._fail(f"gradient hook of {reducer.names[index]}", exc), exc)

        return hook

    def drain(self) -> None:
        """Mark the gradients whose hooks only logged them, in the order they arrived."""
        reducer = self.reducer
        assert reducer is not None
        indices, grads = self.arrivals.take()  # not expecting: only counted as used
        try:
            reducer.mark_many(indices, grads)
        except Exception as exc:
            if peer_unreduced(exc) and self._defer(exc):
                return
            raise_from(self._fail(f"gradient hook of {reducer.names[reducer.marking]}", exc), exc)

    def expect_backward(self, unsynced: bool = False) -> None:
        """A synchronised forward pass ended: its backward pass starts at the next hook.
        ``unsynced``: a ``no_sync`` one, which the reducer reduces all the same."""
        self.sync_pending = True
        self.unsynced = unsynced
        self.nosync_pending = False  # a no_sync forward whose backward never came
        self.forward_thread = threading.get_ident()
        arrivals = self.arrivals
        arrivals.hooks_last()  # a hook of the user's changes .grad before it is reduced
        if arrivals.any_logged and not arrivals.hooks_unchanged():
            arrivals.disable()  # another hook could change .grad before the log is read
