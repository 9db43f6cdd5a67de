"""The failure channel on a c10d process group: its store, heartbeats, bounded waits, abort.

Every user of the torch backend that waits on peers (the distributed backward, the DDP,
the pipeline runtime) does it through this module::

    channel = failure_channel(group, f"dist_autograd/{context_id}")
    try:
        work = group.recv([buf], src, tag)
        wait_work(work, channel, timeout=60.0, what=f"recv from rank {src}")
    except Exception as exc:
        channel.post("recv", f"{type(exc).__name__}: {exc}")   # the others stop too
        raise

The channel lives in the group's own c10d store (out of band: it works on gloo and NCCL
alike, and while a collective is stuck). Each process bumps a heartbeat for each group it
takes part in, so a waiter names a rank that was killed or frozen. Waits never call an
unbounded ``work.wait()`` on the caller's thread: on gloo a ``wait(timeout)`` that runs
out closes the group's connections, and ``is_completed`` of a send or receive stays false
until ``wait()`` is called, so a :class:`Waiter` thread waits while the caller watches.
After a fatal failure :func:`abort_group` drops the group without waiting on its peers,
so ``destroy_process_group`` and process exit return. Which rank a failure lost (the
peer whose heartbeat stopped) is worked out in :mod:`~xgrad.torch_backend.lost_rank`;
its names are importable from here too, as are the waiter threads
(:mod:`~xgrad.torch_backend.waiter`).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from xgrad.failure import (
    FailureChannel,
    KeyValueStore,
    check_seconds,
    default_seconds,
)
from xgrad.failure_wait import wait_until
from xgrad.heartbeat import Heartbeat, Liveness
from xgrad.torch_backend.group_gone import note_aborted
from xgrad.torch_backend.lost_rank import (
    check_lost,
    poisoned,
    silent_peer,
    still_silent,
    transfer_error,
    transfer_failed,
)
from xgrad.torch_backend.stores import (
    forget_guards,
    group_key,
    group_ranks,
    group_store,
    guarded_store,
    resolve_group,
)
from xgrad.torch_backend.waiter import Waiter, Waiters, close_running

__all__ = [
    "Waiter",
    "Waiters",
    "abort_group",
    "check_lost",
    "failure_channel",
    "group_ranks",
    "group_store",
    "guarded_store",
    "poisoned",
    "silent_peer",
    "start_heartbeat",
    "still_silent",
    "stop_heartbeat",
    "transfer_error",
    "transfer_failed",
    "wait_posted",
    "wait_work",
]

#: store namespace of the heartbeats (inside the group's own store namespace).
HEARTBEAT_PREFIX = "xgrad/heartbeat"

#: store namespace of the steps' failure channels (:func:`failure_channel`).
CHANNEL_PREFIX = "xgrad/failure"

#: how long exit waits, in all, for the heartbeat and waiter threads to end.
EXIT_WAIT = 2.0

_heartbeats: dict[str, Heartbeat] = {}
_lock = threading.Lock()


def start_heartbeat(
    group: Any = None, *, interval: float | None = None, store: KeyValueStore | None = None
) -> Heartbeat:
    """Start (once per group and process) the thread that tells peers this process lives.

    ``store`` (default: the group's) takes the first beat, on the caller's thread: a
    guarded one bounds it. The thread beats on the group's store itself, unguarded: a host
    that froze for a while must not stop this process's heartbeat for good.
    """
    pg = resolve_group(group)
    key = group_key(pg)
    with _lock:
        beat = _heartbeats.get(key)
    if beat is None or not beat.alive:
        raw = group_store(pg)
        beat = Heartbeat(
            raw if store is None else store,
            HEARTBEAT_PREFIX,
            dist.get_rank(),
            interval,
            beat_store=raw,
        )
        with _lock:
            old = _heartbeats.get(key)
            if old is not None and old.alive:  # another thread started one meanwhile
                beat.stop()
                return old
            _heartbeats[key] = beat
    return beat


def stop_heartbeat(group: Any = None, *, aborted: bool = False) -> None:
    """Stop this process's heartbeat for ``group`` (peers will then see it as gone, or as
    having aborted the group when ``aborted``)."""
    with _lock:
        beat = _heartbeats.pop(group_key(group), None)
    forget_guards(group_key(group))
    if beat is not None:
        beat.stop(wait=1.0, aborted=aborted)


def _stop_beats(deadline: float, *, aborted: bool = False) -> None:
    """Stop every heartbeat; wait for their threads until ``deadline`` (monotonic).
    ``aborted``: the last beat tells the peers this process aborted the groups."""
    with _lock:
        beats = list(_heartbeats.values())
        _heartbeats.clear()
    forget_guards()
    for beat in beats:
        beat.stop(aborted=aborted)  # every thread told first, then joined: the waits overlap
    for beat in beats:
        beat.stop(wait=max(deadline - time.monotonic(), 1e-3))


@atexit.register
def _stop_all() -> None:
    """Stop every heartbeat and let the waiter threads end, before the interpreter finalizes.

    Every live pipeline runtime holds an idle waiter, which ends only once closed (or its
    runtime collected, :class:`Waiters`): each is closed here, and all the threads are
    joined against one deadline. Left open and joined one by one with half a second each,
    20 runtimes held the exit for 10 s. A thread stuck on a dead peer stays parked
    (daemon) once the deadline passed.
    """
    deadline = time.monotonic() + EXIT_WAIT
    _stop_beats(deadline)
    close_running(deadline)


def failure_channel(
    group: Any,
    namespace: str,
    *,
    heartbeat_interval: float | None = None,
    heartbeat_timeout: float | None = None,
) -> FailureChannel:
    """The failure channel of one step (``namespace``, e.g. a context id) on ``group``.

    Every rank of the step must use the same ``namespace``, and a fresh one per step, so
    that a failure of one step is not seen by the next. Ranks in errors are global ranks.

    Args:
        group: the process group (None: the default group).
        namespace: the step's name within the group's store.
        heartbeat_interval: seconds between heartbeats (default ``XGRAD_HEARTBEAT_INTERVAL``
            or 0.5).
        heartbeat_timeout: a peer whose heartbeat did not move for this long is declared
            unresponsive (default ``XGRAD_HEARTBEAT_TIMEOUT`` or 10).
    """
    pg = resolve_group(group)
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace={namespace!r} must be a non-empty string")
    store = guarded_store(pg, timeout=heartbeat_timeout)
    start_heartbeat(pg, interval=heartbeat_interval, store=store)
    me = dist.get_rank()
    liveness = Liveness(
        store,
        HEARTBEAT_PREFIX,
        [r for r in group_ranks(pg) if r != me],
        interval=heartbeat_interval,
        timeout=heartbeat_timeout,
    )
    return FailureChannel(store, f"{CHANNEL_PREFIX}/{namespace}", me, liveness)


def wait_work(
    work: Any,
    channel: FailureChannel | None,
    *,
    timeout: float | None = None,
    what: str,
    waiter: Waiter | None = None,
    peer: int | None = None,
    prefix: str = "",
) -> None:
    """Wait for a c10d ``Work`` (send, recv, collective), bounded and watching the channel.

    Args:
        work: the ``Work`` an async c10d call returned.
        channel: the step's failure channel (None: only the timeout bounds the wait).
        timeout: seconds (default ``XGRAD_TIMEOUT`` or 60).
        what: what is awaited, for the timeout's message (``"recv from rank 2"``).
        waiter: the :class:`Waiter` thread to use (default: a new one for this wait).
        peer: the other side of a send or receive, named first when the work fails
            (gloo reports a connection a peer's death closed). Without it the heartbeats
            name the rank that stopped answering (see :func:`transfer_failed`), so a
            collective or a receive names the rank that died, never the waiting rank.
        prefix: put before the failure's text in the raised message.

    Raises:
        xgrad.failure.RankError: a failure any rank posted, a peer whose heartbeat
            stopped, or the work's own error (posted first, so the other ranks stop too);
            ``RankUnresponsiveError`` when ``timeout`` ran out or a peer was lost.
        RuntimeError: the work's own error, without a channel.
    """
    seconds = check_seconds("timeout", default_seconds("timeout") if timeout is None else timeout)
    own = waiter is None
    waiter = Waiter() if waiter is None else waiter
    event, error = waiter.submit(work)
    if own:
        waiter.close()
    wait_until(event, channel, timeout=seconds, what=what, prefix=prefix)
    if error:
        if channel is None:
            raise error[0]
        raise transfer_failed(channel, what, error[0], peer, prefix=prefix) from error[0]


def wait_posted(
    work: Any,
    channel: FailureChannel,
    *,
    timeout: float | None = None,
    what: str,
    peer: int | None = None,
    prefix: str = "",
) -> None:
    """Wait, on this thread, for a transfer whose other side is known to be posted.

    For a receive whose send the peer announced, or a send the peer confirmed it
    received: the transfer needs only the peer's communication thread, so it is done in
    microseconds, without the thread hand-off of :func:`wait_work`. The wait is still
    bounded: a peer that froze in that moment fails it after ``timeout`` (which closes
    gloo's connections, as the peer is lost anyway), named as the rank that stopped.

    Raises:
        xgrad.failure.RankError: posted first (see :func:`transfer_failed`).
    """
    seconds = check_seconds("timeout", default_seconds("timeout") if timeout is None else timeout)
    try:
        work.wait(timedelta(seconds=seconds))
    except Exception as exc:
        raise transfer_failed(channel, what, exc, peer, prefix=prefix) from exc


def abort_group(group: Any = None) -> None:
    """Drop ``group`` after a fatal failure without waiting for its peers.

    Stops this process's heartbeat for it, its last beat telling the peers of the abort
    (they name it at once: "rank 0: aborted the process group ..."), and aborts its
    backend (pending sends and receives are abandoned; NCCL communicators are aborted),
    then removes it like
    ``destroy_process_group`` does, which must not be called for it afterwards. With the
    default group, every group is dropped. Calling it for a group already gone does nothing.
    """
    pg = resolve_group(group) if group is not None or dist.is_initialized() else None
    if pg is None:
        return
    if group is None or group == dist.group.WORLD:
        # Heartbeats only: the waiters on the group end once it is aborted (below), and
        # the runtimes' idle ones close with their runtime (at exit, if not before).
        _stop_beats(time.monotonic() + EXIT_WAIT, aborted=True)
    else:
        stop_heartbeat(pg, aborted=True)
    note_aborted(group)  # its DDPs, used again, name the abort (not c10d's KeyError)
    with contextlib.suppress(ValueError):  # already destroyed or aborted
        dist.distributed_c10d._abort_process_group(group)
