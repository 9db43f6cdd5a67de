"""Under ``join()``: a rank still training that stops in a failed step tells the joined ranks.

A rank that has joined shadows a failed step of the ranks still training and begins the
next step with them, with its fresh private group, as they do at their next forward pass
(:mod:`.join_hook`); it raises the failure when ``join()`` ends. A rank still training
that raises the failure out of its ``with ddp.join():`` block instead, its process alive
(the user catches it outside), runs no next forward pass: the joined ranks waited for it
in the failed step's round, or in the fresh group's making, to the DDP's timeout. So:

* xgrad's :class:`~.join.Join`, left by an exception in a step that failed (a rank's
  error), posts a note of kind :data:`LEFT` to that step's channel, naming this rank
  (:func:`post_left`; a few store writes, nothing waited for).
* A joined rank waiting in the failed step's round (which waits past the step's failure)
  ends the wait on a note (:func:`check_left`, from the round's wait).
* Every rank under ``join()`` marks, before it makes the fresh group of the step after a
  failed one, that it makes it (:func:`~.ddp_leftovers.mark_next`). A rank that makes it
  ahead of the others (one that has joined, or leaves ``join()`` plainly) marks, then
  waits for every other rank's mark (:func:`wait_for_next`): a note ends that wait.
  So does a rank still training under xgrad's ``Join`` that caught the failure inside
  the block and goes on with its next pass (:func:`training_gate`): making the group
  with a rank that left raising, it waited to the group's timeout, then blamed a rank
  that had joined (which stopped at once on the note). The marks cost nothing more:
  making the group waits for every rank anyway.

* A failure raised at the forward pass after its step (a backward pass that left buckets
  unreduced: :data:`~.ddp_pass_end.UNREDUCED`) is raised at the pass that begins the step
  after it, before its count; the joined ranks began that step with the others (their
  shadow of the backward pass saw the failure) and wait in their count. The rank that
  leaves then relays the failure to the step it is in (:func:`carried_over`), and its
  note goes there, where the joined rank's count looks for notes (:func:`wait_count`);
  its part of that count is sent too (a zero, not waited for), so that no all-reduce
  is left pending on the join group (the ranks that all left pair theirs).

On a note, the joined rank raises the step's failure at once, naming the rank where it
started and the one that left (:func:`raised_past`), without making the group: no rank
began the next step, and each begins it at its next forward pass, with the fresh group
(a rank whose round was open enters it with ``FAIL`` there first, which the joined
rank's abandoned part of the round meets), so a later join context or step trains.

PyTorch's own ``Join([ddp])`` runs no hook when its block is left by an exception: there
the joined ranks still raise only at the DDP's timeout.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from xgrad.failure import Failure, FailureChannel, RankError, error_for
from xgrad.heartbeat import COLLECTIVE, waiting_for
from xgrad.torch_backend.ddp_leftovers import carried_key, next_marks

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel
    from xgrad.torch_backend.ddp_failure import StepWatch

__all__ = [
    "LEFT",
    "carried_key",
    "carried_over",
    "check_left",
    "left_raising",
    "post_left",
    "raised_past",
    "training_gate",
    "wait_count",
    "wait_for_next",
    "was_carried",
]

#: the kind of the note (never a step's first failure: posted after one).
LEFT = "left"

#: what the note of a rank that left ``join()`` says it did.
LEFT_JOIN = "left join() raising this failure: the ranks that had joined stop shadowing"


def post_left(channel: FailureChannel, message: str = LEFT_JOIN) -> None:
    """This rank stops in the step whose failure ``channel`` holds (it leaves ``join()``
    raising it; ``message`` says so): a note of its own ticket (deleted with the step's
    others, :mod:`.ddp_leftovers`). Not :meth:`~xgrad.failure.FailureChannel.post`,
    which keeps a step's first failure only."""
    store = channel.store
    ticket = store.add(f"{channel.prefix}/failures", 1)
    channel.tickets.append(ticket)
    note = Failure(channel.rank, "join()", message, kind=LEFT)
    store.set(f"{channel.prefix}/failure/{ticket}", note.to_bytes())


def carried_over(watch: StepWatch) -> Failure | None:
    """The failure of the step before, where this rank raised it at the forward pass that
    began the step it is in (a pass that left buckets unreduced): relayed to this step
    (unless a rank that left did, or it has a failure of its own), where the joined
    ranks look for the note; else ``None``."""
    failure = watch.ended_failed
    if watch.raised_at != watch.step or failure is None:
        return None
    channel = watch.channel
    channel.store.set(carried_key(channel.prefix), b"1")  # before it: who reads one sees it
    if channel.poll() is None:
        channel.relay(failure)
    return failure


def was_carried(channel: FailureChannel) -> bool:
    """Whether ``channel``'s failure (posted) was carried over from the step before: the
    joined ranks do not begin the next step ahead on it (they count first: the ranks
    that left sent their part), one lookup."""
    return bool(channel.store.check([carried_key(channel.prefix)]))


def wait_count(
    watch: StepWatch,
    work: Any,
    timeout: float,
    also: Callable[[], None] | None = None,
    entered: str = "",
) -> None:
    """A rank's count of the ranks still training (the join context's all-reduce): a
    note in the step it is in (:func:`post_left`) raises the step's failure, also once
    the count is done in a step begun after a failed one (the ranks that left with a
    carried-over failure sent their part of it); past ``timeout``, the all-reduce's own
    error (the context names the rank). ``also``: another check between naps.
    ``entered``: the namespace of the step the join context began in, whose notes (an
    earlier context's) are not this count's."""
    done = threading.Lock()  # a held lock the completion releases (as the watch's waits)
    done.acquire()
    work.get_future().add_done_callback(lambda _: done.release())
    deadline = time.monotonic() + timeout
    while not done.acquire(timeout=watch.poll):
        if watch.channel.prefix != entered:
            check_left(watch.channel)
        if also is not None:
            also()
        if time.monotonic() >= deadline:
            break
    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
    if watch.ended_failed is not None and watch.channel.prefix != entered:
        check_left(watch.channel)


def left_raising(channel: FailureChannel) -> Failure | None:
    """The first note (:func:`post_left`) posted to ``channel``'s step, if any (lookups,
    only after a failed step). A ticket whose record is not written yet (another rank's,
    posting) is skipped: it is read at the next look."""
    store = channel.store
    counter = f"{channel.prefix}/failures"
    if channel.poll() is None:
        return None
    for ticket in range(2, int(store.get(counter)) + 1):
        key = f"{channel.prefix}/failure/{ticket}"
        if store.check([key]):
            note = Failure.from_bytes(store.get(key))
            if note.kind == LEFT:
                return note
    return None


def raised_past(kept: BaseException | None, channel: FailureChannel, note: Failure) -> RankError:
    """What a joined rank raises once ``note`` says a rank stopped: the step's failure
    (``kept``, the one it would raise as ``join()`` ended, else ``channel``'s), naming
    the ranks' other failures, then the note."""
    if isinstance(kept, RankError):
        first, also = kept.failure, kept.also
    else:
        posted = channel.poll()
        assert posted is not None  # a note is posted after the step's failure
        first, also = posted, tuple(channel.others())
    also = tuple(f for f in also if f != note)
    return error_for(first, channel.rank, also=(*also, note))


def check_left(channel: FailureChannel) -> None:
    """In a wait that goes on past the step's failure (a join round): a note ends it."""
    note = left_raising(channel)
    if note is not None:
        raise raised_past(None, channel, note)


def wait_for_next(
    watch: StepWatch,
    channel: FailureChannel,
    kept: BaseException | None,
    notes: bool = True,
    aborted: bool = False,
) -> None:
    """A rank that begins the step past ``channel``'s failed one ahead of the others, its
    mark written: wait until every rank has marked (each makes the fresh group now or is
    about to); a note raises the step's failure (``kept`` first) instead, unless not
    ``notes`` (the step failed before this join context: its notes were an earlier
    context's). Bounded by the DDP's timeout; a lost peer raises too. ``aborted``: a
    note of a rank that aborted the group first (``abort_group`` in its handler) ends
    the wait instead, for :meth:`~.ddp_failure.StepWatch.begin_step` to name it (what
    matters more: a new group is needed)."""
    marks = next_marks(channel.prefix, watch.ranks)
    store = channel.store
    before = waiting_for(COLLECTIVE)  # published with the heartbeat: a late peer is named
    try:
        started = time.monotonic()
        while True:
            marked = store.check(marks)
            # After the marks: a rank that stopped and went on at once (a new join
            # context) marks too, after its note, and this rank's context is over.
            note = left_raising(channel) if notes else None
            if note is not None:
                if aborted and _aborted(channel):
                    return
                raise raised_past(kept, channel, note)
            if marked:
                return
            channel.check(posted=False)  # a rank that died or froze
            waited = time.monotonic() - started
            if waited >= watch.timeout:
                raise _timed_out(channel, waited)
            time.sleep(watch.poll)
    finally:
        waiting_for(before)


def _aborted(channel: FailureChannel) -> bool:
    """Whether a peer aborted the group (read now: its abort comes before its note)."""
    liveness = channel.liveness
    if liveness is None:
        return False
    liveness.read(force=True)
    return bool(liveness.aborted())


def training_gate(ddp: DistributedDataParallel) -> Callable[[FailureChannel], None] | None:
    """The gate of a rank still training in xgrad's ``Join`` (whose exit posts the notes),
    for a pass that begins the step after a failed one (:func:`_training_gate`); ``None``
    elsewhere (PyTorch's ``Join`` runs no hook as a rank leaves it raising: no note
    comes). A few attribute reads a pass: the rest only after a failed step."""
    config = ddp._join_config
    if not config.enable or ddp._counted_config is not config or ddp._join_order is None:
        return None
    return functools.partial(_training_gate, ddp)


def _training_gate(ddp: DistributedDataParallel, failed: FailureChannel) -> None:
    """:func:`wait_for_next`: a note raises the step's failure, naming the rank that left
    ``join()`` raising it (a step that failed before this context, whose notes were an
    earlier one's, only waits for the marks); a peer that aborted the group is named by
    the group's making, after it."""
    order = ddp._join_order
    hook = next((h for h in order.hooks if getattr(h, "ddp", None) is ddp), None)
    entered = order.entered if hook is None else hook.entered
    wait_for_next(ddp._watch, failed, None, failed.prefix != entered, aborted=True)


def _timed_out(channel: FailureChannel, waited: float) -> RankError:
    """:func:`wait_for_next` ran out: a rank neither began the next step nor left
    ``join()`` (not posted: the step's first failure is posted already, and named)."""
    message = (
        f"timed out after {waited:g} s (a rank still training neither began the step after "
        "the failed one nor left join() raising it)"
    )
    failed = channel.poll()
    also = () if failed is None else (failed,)
    what = "join: the marks of the ranks that make the step's fresh group"
    return error_for(Failure(channel.rank, what, message, "timeout"), channel.rank, also=also)
