"""Naming the rank a failure lost: the peer whose heartbeat stopped, not the rank that noticed.

Gloo fails a send, receive or collective locally ("Connection closed by peer") when a
peer dies, so the rank that raises is rarely the one at fault. Kept apart from the
channel, heartbeats and waits in :mod:`xgrad.torch_backend.failure` (which re-exports
these names) because it only reads a :class:`~xgrad.failure.FailureChannel`'s store and
heartbeats: it starts nothing and touches no process group. Used after a transfer
failed (:func:`transfer_failed`) and at the start of the step after one that lost a
rank (:func:`check_lost`), and after a peer's poison (:func:`poisoned`).
"""

from __future__ import annotations

import time

from xgrad.failure import Failure, FailureChannel, RankError, error_for

__all__ = [
    "CLOSED_BEFORE",
    "TIMED_OUT_LIVE",
    "absent_peer",
    "check_aborted",
    "check_lost",
    "poisoned",
    "silent_peer",
    "still_silent",
    "transfer_error",
    "transfer_failed",
]


#: what a closed connection means when every peer still beats.
CLOSED_BEFORE = (
    "every rank still answers: the group's connection was closed earlier, by a wait that "
    "ran out its timeout or a peer that was lost, and the group cannot carry messages "
    "again; make a new one (torch.distributed.new_group)"
)

#: what a transfer that ran out its timeout means when every peer still beats.
TIMED_OUT_LIVE = (
    "every rank still answers: one that runs fewer steps or skips this collective or "
    "transfer leaves the others waiting"
)


#: seconds a transfer that ran out its timeout reads the heartbeats for. A peer frozen or
#: dead during that wait has been silent for the whole timeout already; a second more (and a
#: beat or two) catches one that stopped just before it ended. Waiting the 1.5 heartbeat
#: timeouts that a connection closed at once needs made a 5 s DDP timeout raise after 20 s
#: when every rank was alive.
_AFTER_TIMEOUT = 2.0


#: gloo's words for an operation behind one that ran out its timeout on the same
#: connection, which that timeout closed.
_CLOSED_BY_TIMEOUT = "caused pair closure"


def transfer_failed(
    channel: FailureChannel,
    what: str,
    exc: BaseException,
    peer: int | None,
    *,
    prefix: str = "",
    fresh: bool = False,
    waited: bool = False,
) -> RankError:
    """Post a failed send, receive or collective (``exc``) and return the error to raise.

    Gloo fails a transfer locally ("Connection closed by peer") when a peer died, so the
    failure is rarely this rank's own: it is worded for the rank that stopped answering.
    A failure another rank posted first is the origin. Otherwise the heartbeats are read
    until a peer is seen stopped (within 1.5 heartbeat timeouts; ``peer``, the other side
    of a send or receive, first when it is among them): that rank is named. When every
    peer still beats, ``peer`` is named if given (its side of the transfer failed; "did
    not answer within the timeout" when the transfer timed out: it is late, not gone),
    except for a connection closed (the group was lost before, by a timed-out wait: a live
    peer named as stopped misled), else this rank in ``what``. ``fresh``: no wait on the
    group timed out before this one's step (the DDP makes a new group after a failed
    step), so a connection its timeout closed ("caused pair closure") was closed by
    another operation of this step that timed out (the used-parameter map, waited for
    before the bucket it went out after): a timeout, whose late rank is named.
    ``waited``: ``exc`` ended a wait that ran its whole timeout whatever its words (c10d's
    "Wait timeout", gloo's "Connect timeout": a process group that could not be made).
    """
    channel.check(prefix=prefix)
    text = f"{type(exc).__name__}: {exc}"
    timed_out = waited or "timed out" in text.lower() or (fresh and _CLOSED_BY_TIMEOUT in text)
    # Who waited for nobody when the wait ran out: read before the heartbeats are watched
    # for a stop, by whose end a rank that was late (asleep, still beating) may have come
    # and wait in the collective like the rest, and be taken for on time.
    idle_then = (
        channel.liveness.idle()
        if timed_out and peer is None and channel.liveness is not None
        else []
    )
    silent = silent_peer(channel, prefer=peer, within=_AFTER_TIMEOUT if timed_out else None)
    late = silent is None and peer is not None and timed_out  # it still beats
    waited_on = peer
    if late and peer is not None and channel.liveness is not None:
        # The peer may be waiting itself, for a rank that is late: that one is named.
        peer = channel.liveness.end_of_waits(peer, channel.rank)
    if silent is None and peer is None and timed_out and channel.liveness is not None:
        # A collective: a live rank that waits for nobody is late for it.
        idle = channel.liveness.idle() or idle_then
        if idle:
            late, peer = True, idle[0]
    # gloo's words for a pair a timed-out wait (here or on the peer) closed
    closed = ("Connection closed" in text or _CLOSED_BY_TIMEOUT in text) and not late
    if silent is None and not closed:
        silent = peer
    if silent is None:
        if closed:  # every peer still beats: the group was lost before, not the peer
            text += f" ({CLOSED_BEFORE})"
        elif timed_out:
            text += f" ({TIMED_OUT_LIVE})"
        failure = channel.post(what, text)
    elif late:
        via = (
            f" (rank {channel.rank} waited for it in the collective)"
            if waited_on is None
            else ""
            if silent == waited_on
            else f" (rank {waited_on} waits for it)"
        )
        message = (
            f"did not answer within the timeout{via}: rank {channel.rank}'s {what} failed: "
            f"{text} ({TIMED_OUT_LIVE})"
        )
        failure = channel.post("", message, kind="timeout", rank=silent)
    else:
        # The waiting rank named with its wait: ``what`` is its action, not the lost one's.
        waiting = f" while rank {channel.rank} waited in {what}"
        liveness = channel.liveness
        if liveness is not None and silent in liveness.aborted():
            message = f"{liveness.lost([silent], 0.0, waiting)} ({text})"
        else:
            message = f"stopped answering{waiting}: {text}"
        failure = channel.post("", message, kind="unresponsive", rank=silent)
    return error_for(failure, channel.rank, prefix)


def transfer_error(
    channel: FailureChannel,
    what: str,
    exc: BaseException,
    peer: int | None,
    *,
    fresh: bool = False,
    waited: bool = False,
) -> RankError:
    """:func:`transfer_failed`, with a failure another rank posted first returned as the
    error, not raised: for a caller that wraps whichever it gets."""
    try:
        return transfer_failed(channel, what, exc, peer, fresh=fresh, waited=waited)
    except RankError as posted:
        return posted


def silent_peer(
    channel: FailureChannel, *, prefer: int | None = None, within: float | None = None
) -> int | None:
    """The peer whose heartbeat stopped, read for up to ``within`` seconds (default: 1.5
    heartbeat timeouts); None if all beat.

    For a transfer that failed locally: a killed peer's heartbeat stops at once, so it is
    seen stopped after about one second (or a short heartbeat timeout). A failure another
    rank posts meanwhile names its own origin; this returns None then (the caller's post
    returns that failure).
    """
    liveness = channel.liveness
    if liveness is None or not liveness.ranks:
        return None
    if within is None:
        within = liveness.timeout * 1.5
    limit = time.monotonic() + within
    nap = max(liveness.interval, 0.05)
    while True:
        if channel.poll() is not None:
            return None
        liveness.read(force=True)
        stale = liveness.stale(older_than=min(liveness.timeout, 1.0))
        if stale:
            return prefer if prefer in stale else stale[0]
        if time.monotonic() >= limit:
            return None
        time.sleep(nap)


def absent_peer(
    channel: FailureChannel, what: str, exc: BaseException, waited: float | None = None
) -> RankError:
    """Post that ``what`` (making a process group, which waits for every member through the
    store) failed with ``exc``, and return the error: naming a peer that never started its
    heartbeat (dead before, or not there: c10d says only "Wait timeout"), else one whose
    heartbeat stopped, else a live one late for it, else this rank (as
    :func:`transfer_failed` does).

    ``waited``: seconds the making took, its heartbeats read as it began and its makers
    published as waiting for every rank (:data:`~xgrad.heartbeat.COLLECTIVE`). A making
    that ran out its timeout (c10d's "Wait timeout", gloo's "Connect timeout") names at
    once a live peer that waits for nobody (asleep in its own code): posted so before the
    peer comes, it raises that instead of connecting to the address this rank gave up
    (:meth:`~.ddp_failure.StepWatch.begin_step`). Read as a connection lost at once, the
    heartbeats were watched for 1.5 heartbeat timeouts (15 s by default) past the
    group's own timeout, and the rank that gave up named itself.
    """
    channel.check()
    liveness = channel.liveness
    text = f"{type(exc).__name__}: {exc}"
    if liveness is not None:
        liveness.read(force=True)
        absent = liveness.never_beat()
        if absent:
            others = f" (also ranks {absent[1:]})" if len(absent) > 1 else ""
            message = (
                f"never joined {what}{others}: no heartbeat from it (dead, or not started) "
                f"while rank {channel.rank} waited: {text}"
            )
            failure = channel.post("", message, kind="unresponsive", rank=absent[0])
            return error_for(failure, channel.rank)
    ran_out = waited is not None and "timeout" in text.lower()
    if ran_out and liveness is not None and waited is not None:
        # A counter that stood still for half the wait (two beats at least) stopped: that
        # rank is named from the heartbeats below, not as late.
        least = 2 * liveness.interval
        stale = liveness.stale(older_than=min(liveness.timeout, max(waited / 2, least)))
        late = [r for r in liveness.idle() if r not in stale] if waited / 2 >= least else []
        if late and not stale:
            message = (
                f"did not answer within the timeout (rank {channel.rank} waited {waited:.3g} s "
                f"for it in {what}; it waits for no rank: busy in its own code, or not there "
                f"yet): {text} ({TIMED_OUT_LIVE})"
            )
            failure = channel.post("", message, kind="timeout", rank=late[0])
            return error_for(failure, channel.rank)
    return transfer_error(channel, what, exc, None, waited=ran_out)


def check_aborted(channel: FailureChannel, what: str) -> None:
    """Before ``what`` (making a process group): raise, naming it, if a peer aborted the
    group (``abort_group``), which would leave this rank waiting for it to the timeout and
    raising c10d's bare "Wait timeout"; one that aborts meanwhile is named after that."""
    liveness = channel.liveness
    if liveness is None:
        return
    liveness.read(force=True)
    aborted = liveness.aborted()
    if aborted:
        message = liveness.lost(aborted, 0.0, f" before rank {channel.rank} began {what}")
        failure = channel.post("", message, kind="unresponsive", rank=aborted[0])
        raise error_for(failure, channel.rank)


def check_lost(channel: FailureChannel, lost: Failure | None, *, prefix: str = "") -> None:
    """At the start of a step: raise the last step's failure again if it lost a rank that is
    still silent (dead or still frozen), so the step fails at once, named, instead of waiting
    on that rank (making a process group with it, a collective)."""
    if lost is not None and lost.kind == "unresponsive" and still_silent(channel, lost.rank):
        raise error_for(lost, channel.rank, prefix)


def still_silent(channel: FailureChannel, rank: int) -> bool:
    """Whether ``rank``'s heartbeat is still not moving (over a few beats).

    At the start of a step after one that lost ``rank``: a rank that died or stays frozen
    makes the new step raise the same named error at once instead of waiting on it.
    """
    liveness = channel.liveness
    if liveness is None or rank not in liveness.ranks:
        return False
    liveness.read(force=True)
    time.sleep(liveness.interval * 3)
    liveness.read(force=True)
    return rank in liveness.stale(older_than=liveness.interval * 2.5)


def poisoned(channel: FailureChannel, peer: int, what: str, timeout: float = 2.0) -> RankError:
    """The error of a wait that got poison from ``peer``.

    A rank that fails while alive posts its failure first, then poisons every message it
    still owes, so the failure is normally read at once. One that does not show up within
    ``timeout`` (at most 2 s) is posted for the peer, naming it, so every rank stops.
    """
    deadline = time.monotonic() + min(timeout, 2.0)
    while time.monotonic() < deadline:
        failure = channel.poll()
        if failure is not None:
            return error_for(failure, channel.rank)
        time.sleep(0.002)
    failure = channel.post(what, f"rank {peer} sent poison without posting a failure")
    return error_for(failure, channel.rank)
