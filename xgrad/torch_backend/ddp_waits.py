"""The step watch's bounded waits: each watched, none past the timeout, a lost peer named.

A wait for a c10d ``Work`` or an event polls briefly (:mod:`.ddp_spin`), then naps,
checking the step's failure channel between naps: a peer's posted failure, a dead or
frozen peer, a skipped backward pass (:mod:`.ddp_skipped`) or the DDP's timeout raise
the step's :class:`~xgrad.failure.RankError`, naming the other ranks' failures, and a
private group that can no longer match up is dropped. Mixed into
:class:`~.ddp_failure.StepWatch`, which keeps the steps (namespaces, posting, the private
group's making); kept apart so that the one piece that waits is read on its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from xgrad.failure import FailureChannel, RankError, error_for
from xgrad.heartbeat import COLLECTIVE, waiting_for
from xgrad.raising import raise_from
from xgrad.torch_backend.ddp_skipped import check_skipped
from xgrad.torch_backend.ddp_spin import spin_until
from xgrad.torch_backend.failure import transfer_error
from xgrad.torch_backend.join_leave import check_left

__all__ = ["ABANDONED", "StepWaits"]

#: groups a wait left with its collective pending after a failure (a peer's post: no peer
#: matches it any more), whose connections are closed as the process ends
#: (:mod:`.ddp_exit`): else gloo aborted the process at exit ("terminate called after
#: throwing an instance of 'gloo::IoException'") when a peer closed its end. c10d holds
#: them too until destroyed; this list, until the process ends or destroys every group.
ABANDONED: list[Any] = []


class StepWaits:
    """Mixed into :class:`~.ddp_failure.StepWatch`: its waits and what a failed one drops."""

    channel: FailureChannel
    timeout: float
    poll: float
    spin: float
    cuda_spin: float
    group: Any
    lost: RankError | None

    if TYPE_CHECKING:

        def post(self, where: str, exc: BaseException | str) -> RankError: ...  # StepWatch's

    def wait_work(
        self, work: Any, what: str, cuda: bool = False, *, posted: bool = True, skips: bool = True
    ) -> None:
        """Wait for a c10d ``Work``; a peer's failure, a dead or frozen peer or the timeout raise.

        The work is polled for :attr:`spin` seconds first (:attr:`cuda_spin` for a
        collective of CUDA tensors, ``cuda``), so the thread stays hot for what follows
        the wait; then the blocking wait, which counts the spin as waited. ``posted=False``:
        a failure posted to the step does not end the wait (a collective every rank still
        enters, which tells what the step did: a join round). ``skips=False``: a peer's
        note that its backward pass of the step never reached DDP does not end the wait
        either (a collective of the forward pass, which that peer has left behind: see
        :meth:`wait_event`).
        """
        spin = self.cuda_spin if cuda else self.spin
        if work.is_completed() or (spin > 0.0 and spin_until(work.is_completed, spin)):
            self._finish(work, what)
            return
        # Published with the heartbeat until the failure, if any, is worded: a peer that
        # times out meanwhile must not take this rank for one late for the collective.
        before = waiting_for(COLLECTIVE)
        group = self.group  # (a failure may drop it)
        try:
            # A held lock the completion releases: half the cost of an Event's wait.
            done = threading.Lock()
            done.acquire()
            work.get_future().add_done_callback(lambda _: done.release())
            self.wait_event(done, what, spun=spin, posted=posted, skips=skips)
            self._finish(work, what)
        except RankError:
            pending = group is not None and not work.is_completed()
            if pending and not any(g is group for g in ABANDONED):
                ABANDONED.append(group)
            raise
        finally:
            waiting_for(before)

    def _finish(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise_from(self.failed(exc, what), exc)

    def wait_event(
        self,
        done: threading.Event | threading.Lock,
        what: str,
        spun: float = 0.0,
        *,
        posted: bool = True,
        skips: bool = True,
    ) -> None:
        """Wait for ``done`` (set, or released), checking the channel between naps, never
        past the timeout; ``spun``: seconds already spent polling (counted as waited, and
        the channel checked first); ``posted``: as :meth:`wait_work`'s.

        ``skips=False`` for the forward pass's collectives (the ranks' agreement, the
        buffers' and the rebuilt buckets' broadcasts): a rank that notes a skipped
        backward pass of the step does it at its next forward pass, so it has finished
        these collectives, and a peer still waiting in one (descheduled on a loaded
        machine) only has to see it complete; taking the note for a failure there named
        a rank that had skipped nothing before the peer itself reached its backward pass.
        """
        wait = done.wait if isinstance(done, threading.Event) else done.acquire
        check = (self._check if posted else self._check_past) if skips else self._check_forward
        before = waiting_for(COLLECTIVE)  # published with the heartbeat: a late peer is named
        try:
            waited = spun
            if spun > 0.0:
                check()
                if waited >= self.timeout:
                    raise self.channel.timed_out(what, self.timeout, collective=True)
            while not wait(timeout=self.poll):
                waited += self.poll
                check()
                if waited >= self.timeout:
                    raise self.channel.timed_out(what, self.timeout, collective=True)
        except RankError as error:
            # The operation is still pending (a frozen peer): aborting would wait for it.
            self.drop_group(error, abort=False)
            raise
        finally:
            waiting_for(before)

    def _check(self) -> None:
        """Between naps of a wait: a posted failure, a silent peer, or a peer that said
        its backward pass of this step never reached DDP (:mod:`.ddp_skipped`) raise,
        naming the other failures of the step (:meth:`naming_others`)."""
        self._look(posted=True)

    def _check_past(self) -> None:
        """:meth:`_check` for a wait that goes on past a failure posted to the step (a
        join round): a note that a rank still training stopped in the step ends it
        (:mod:`.join_leave`)."""
        self._look(posted=False)

    def _check_forward(self) -> None:
        """:meth:`_check` for a collective of the forward pass: skip notes are not read."""
        self._look(posted=True, skips=False)

    def _look(self, *, posted: bool, skips: bool = True) -> None:
        # (several names over one body: a test replaces _check alone)
        try:
            self.channel.check(posted=posted)
            if skips:
                check_skipped(self.channel)
            if not posted:
                check_left(self.channel)
        except RankError as error:
            raise_from(self.naming_others(error), error)

    def naming_others(self, error: RankError) -> RankError:
        """``error`` (the step's first failure) naming after it every other rank's failure
        in the channel by now, a line each (read, never waited for, and only when raising:
        of two ranks failing at once a third rank named the first alone); else as it is."""
        if error.also or error.failure != self.channel.poll():
            return error
        also = self.channel.others()
        if not also:
            return error
        return error_for(error.failure, error.raised_on, error.prefix, also)

    def drop_group(self, error: RankError, *, abort: bool) -> None:
        """Stop using the private group when a peer died or froze (or a wait timed out).

        Its collectives cannot match up any more; the next step makes a fresh group
        (every rank sees this step's failure). A group whose operations already failed
        (a dead peer) is aborted, since gloo would otherwise abort the process at exit on
        the closed connection; one with an operation still pending (a frozen peer) is
        left to expire with its timeout, the DDP's, which bounds ``destroy_process_group()``.
        """
        if error.failure.kind == "error" or self.group is None:
            return
        group, self.group, self.lost = self.group, None, error
        if abort:
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(group)

    def failed(self, exc: Exception, what: str, *, posted: bool = False) -> RankError:
        """The error for collective ``what`` failing here with ``exc`` (this rank's own,
        posted, when ``posted``: a comm hook's; else :meth:`explain` ed), its group dropped;
        returned for :func:`~xgrad.raising.raise_from`, so no frame holds it."""
        error = self.post(what, exc) if posted else self.explain(exc, what)
        self.drop_group(error, abort=True)
        return error

    def explain(self, exc: Exception, what: str) -> RankError:
        """A collective that failed locally (gloo's "Connection closed by peer"): the
        failure channel says which rank stopped answering (see
        :func:`~xgrad.torch_backend.failure.transfer_failed`)."""
        if isinstance(exc, RankError):
            return exc
        # fresh: a wait that timed out dropped the group, and the next step makes another
        return self.naming_others(transfer_error(self.channel, what, exc, None, fresh=True))
