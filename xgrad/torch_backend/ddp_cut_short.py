"""What cut a DDP's backward pass short: the exception autograd raised, for the peers.

A gradient hook of the user's (``p.register_hook(fn)``, a hook on an activation, a
module's backward hook) or an autograd function that raises ends the pass on this rank
without DDP's hooks seeing the exception: autograd runs no code of the DDP on its way
out and keeps nothing of it. The pass is posted to the step's failure channel at the
next forward pass (:func:`.ddp_unfinished.post_failed_pass`), and the peers' error named
the rank but said only "the backward pass raised an exception". So, once a DDP has
attached its hooks, autograd's engine is entered through :class:`NotingEngine`, which
notes the exception's type and text (bounded: :data:`NOTED_CHARS`) on each DDP whose
backward pass (synchronised or ``no_sync``, whose failure gives up the step it
accumulated for) began within the call and did not finish, and raises it on unchanged.
While another thread is in a backward call too (two DDPs trained in two threads), only
the passes whose forward pass ran on the raising call's thread are noted: a pass begun
within the call may be the other thread's, which its own exception cuts short (the
first noted text stays: its peers read this thread's words, not its own).
A :class:`~xgrad.failure.RankError` is not noted: the DDP's own hook that raised it
posted it already, or it is a peer's.

It also ends a pass that a reentrant backward (checkpointing with ``use_reentrant=True``)
began: a DDP queues its end-of-pass callback at the pass's first gradient hook, on that
hook's graph task, which is a reentrant call's own when the checkpoint holds the layers
whose gradients come first, and ends with that call, before the outer graph's gradients.
Such a callback, run while a reentrant call is under way (any thread: a CUDA device
thread runs one there) and before the pass is complete, is put off (:func:`put_off`):
the next gradient hook queues it again on its own graph task, and the outermost call
runs it as it returns if no hook came after (as PyTorch's reducer ends the pass at its
last bucket, wherever that is).

A backward call can also raise before any of a DDP's gradient hooks ran (a hook on the
loss or on the model's output, a ``Function`` above the model): the pass never began for
the DDP, and only its forward pass, with gradients on, awaits it. Left so, a ``no_sync``
pass looked like one whose output needed no backward (legal), the step went on, and the
rank's next synchronised pass met its peers' synchronised pass of the step before: every
later step reduced one rank's micro-batches with another's, silently (PyTorch's DDP does
the same); a synchronised pass was settled by a round that named no exception, and under
``join()`` was taken for a forward pass left without its backward (a misuse error, then
timeouts). So an exception leaving an outermost backward call also notes each DDP pass of
that thread still awaiting its backward (:func:`_note_unreached`) as cut short at its
start, with the exception's text; the next forward pass then posts it as any pass cut
short. Where that DDP's backward comes after all (the exception was another graph's), its
first gradient hook begins the pass as usual and its end clears the note.

The engine is swapped only while it is torch's own; another one put in its place (by a
profiler, a library) is left alone, and the peers then hear the generic words again.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.variable import Variable

from xgrad.failure import RankError, describe
from xgrad.torch_backend.ddp_give_up import post_cut_short_pass
from xgrad.torch_backend.ddp_unfinished import UNFINISHED

__all__ = ["NOTED_CHARS", "NotingEngine", "bounded", "note_backward_errors", "put_off"]

#: the most characters of an exception's text sent to the peers (a tensor printed in a
#: message can run to megabytes, and every peer reads it from the store).
NOTED_CHARS = 2000

_NONE: frozenset[Any] = frozenset()

#: a token for each reentrant backward call under way, on any thread (list.append and
#: remove are atomic: no lock).
_NESTED: list[object] = []

#: the thread of each outermost backward call under way (atomic append and remove).
_CALLS: list[int] = []

#: the gradient hooks whose end-of-pass callback ran too early and was put off; each
#: has it in its ``requeue``.
PUT_OFF: set[Any] = set()

#: every DDP's gradient hooks (held weakly), looked through only when a backward call
#: raised: the passes awaiting their backward (:func:`_note_unreached`).
HOOKS: weakref.WeakSet[Any] = weakref.WeakSet()

current_graph_task = torch._C._current_graph_task_id


def bounded(text: str, limit: int = NOTED_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class NotingEngine(torch._C._ImperativeEngine):
    """Torch's autograd engine, noting why a DDP's backward pass was cut short.

    Only the DDP passes that began within this call are noted: one begun before it (the
    outer pass of a reentrant backward, as checkpointing runs one) is noted by the outer
    call, if the exception reaches it; one another thread's call began is left to that
    call (:func:`_note`). The outermost call also runs the end-of-pass
    callbacks put off in it (:func:`put_off`). It costs about 1 µs a backward call,
    nothing a gradient.
    """

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        # Between good steps no pass is under way: nothing is copied.
        before = frozenset(UNFINISHED) if UNFINISHED else _NONE
        token = None if current_graph_task() == -1 else object()  # called from a hook
        thread = threading.get_ident()
        if token is None:
            _CALLS.append(thread)
        else:
            _NESTED.append(token)
        try:
            result = super().run_backward(*args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, RankError):
                with contextlib.suppress(Exception):  # what is raised stays the user's
                    if UNFINISHED:
                        _note(exc, before, thread)
                        if token is None:
                            _post_begun(before, thread)
                    if token is None:
                        _note_unreached(exc, thread)
            if PUT_OFF and token is None:
                _run_put_off(before, run=False)  # cut short: recovered at the next forward
            raise
        finally:
            if token is None:
                _CALLS.remove(thread)
            else:
                _NESTED.remove(token)
        if PUT_OFF and token is None:
            _run_put_off(before, run=True)
        return result


def put_off(hooks: Any, callback: Callable[[], None], complete: bool) -> bool:
    """Whether ``hooks``' end-of-pass ``callback``, running now, is put off: a reentrant
    backward call is under way and the pass is not ``complete``, so this is the end of a
    graph task within the pass, not of the pass. Its next gradient hook (``requeue``) or
    the outermost backward call runs it instead."""
    if complete or not _NESTED:
        return False
    hooks.requeue = callback
    PUT_OFF.add(hooks)
    return True


def _run_put_off(before: frozenset[Any], run: bool) -> None:
    """Run (``run``) or drop the end-of-pass callbacks put off in passes begun since
    ``before``, now that the outermost backward call of the pass returned or raised."""
    for hooks in [h for h in PUT_OFF if h not in before]:
        PUT_OFF.discard(hooks)
        callback, hooks.requeue = hooks.requeue, None
        if run and callback is not None:
            callback()


def _note(exc: BaseException, before: frozenset[Any], thread: int) -> None:
    """``exc``, raised by the backward call of ``thread``, is why the passes begun since
    ``before`` were cut short: those of ``thread``'s forward passes, where another thread
    is in a backward call too (the first noted stays: a reentrant pass's exception
    reaches the outer call too)."""
    text = ""
    alone = all(t == thread for t in list(_CALLS))
    for hooks in list(UNFINISHED):  # (one C call: another thread may change the set)
        if (
            hooks not in before
            and hooks.cut_short is None
            and (alone or hooks.forward_thread == thread)
        ):
            text = text or bounded(describe(exc))
            hooks.cut_short = text


def _post_begun(before: frozenset[Any], thread: int) -> None:
    """The outermost backward call of ``thread`` raised: each pass it began and cut short
    (noted by :func:`_note`) is posted now, outside ``join()``, so that the peers waiting
    for its buckets raise this rank's exception at once. Posted at the next forward pass,
    a rank that had none (the loop's last step, an uncaught exception) or that did
    something else first (saving a checkpoint, another DDP's or the user's collectives)
    left them waiting to the timeout or until its process ended, and then they named it
    as one that stopped answering. A ``no_sync`` pass gives up the step its peers
    accumulate for (:func:`~.ddp_give_up.post_cut_short_pass`, as the next forward
    pass did: that pass still tells what the loop does next, :mod:`.ddp_which_step`);
    not a pipeline stage's, which its runtime gives up with the pipeline step. Not a pass
    noted before any of its hooks ran (the exception may be another graph's:
    :func:`_note_unreached`), nor one under ``join()``, whose counts and rounds order the
    posts."""
    alone = all(t == thread for t in list(_CALLS))
    for hooks in list(UNFINISHED):
        if (
            hooks not in before
            and hooks.cut_short is not None
            and (alone or hooks.forward_thread == thread)
            and not hooks.joining()
            and not (hooks.nosync_open and hooks.pipelined)
        ):
            post_cut_short_pass(hooks.watch, hooks)


def _note_unreached(exc: BaseException, thread: int) -> None:
    """``exc`` left an outermost backward call of ``thread``: each DDP pass whose forward
    pass ran on that thread with gradients on and none of whose gradient hooks ran since
    is noted as cut short at its start (a synchronised one as if its end were queued, a
    ``no_sync`` one as if open), so that the next forward pass, or another DDP's, posts
    it (:mod:`.ddp_unfinished`). Its awaiting flag stays: a backward of the pass that
    comes after all begins it as usual, and its end clears the note."""
    text = ""
    for hooks in list(HOOKS):
        if hooks in UNFINISHED or hooks.cut_short is not None:
            continue
        if hooks.forward_thread != thread:  # (another thread's graph raised: not this pass)
            continue
        if hooks.sync_pending:
            hooks.finalize_queued = True
        elif hooks.nosync_pending:
            hooks.nosync_open = True
        else:
            continue
        text = text or bounded(describe(exc))
        hooks.cut_short = text
        UNFINISHED.add(hooks)


def note_backward_errors(hooks: Any) -> None:
    """Enter autograd through :class:`NotingEngine` from now on (once; not over an engine
    someone else put in torch's place), and look through ``hooks`` (a DDP's gradient
    hooks) when a backward call raises."""
    HOOKS.add(hooks)
    if type(Variable._execution_engine) is torch._C._ImperativeEngine:
        Variable._execution_engine = NotingEngine()
