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
unbounded ``work.wait()``: on gloo a ``wait(timeout)`` that runs out also closes the
connection to the peer (the group is then useless), so completion is polled instead.
After a fatal failure :func:`abort_group` drops the group without waiting on its peers,
so ``destroy_process_group`` and process exit return.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Any, cast

import torch.distributed as dist

from xgrad.failure import (
    FailureChannel,
    Heartbeat,
    KeyValueStore,
    Liveness,
    check_seconds,
    default_seconds,
    wait_until,
)

__all__ = [
    "abort_group",
    "failure_channel",
    "group_ranks",
    "group_store",
    "start_heartbeat",
    "stop_heartbeat",
    "wait_work",
]

#: store namespace of the heartbeats (inside the group's own store namespace).
HEARTBEAT_PREFIX = "xgrad/heartbeat"

_heartbeats: dict[str, Heartbeat] = {}
_lock = threading.Lock()


def _resolve(group: Any) -> Any:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call init_process_group first "
                "(or pass group=)"
            )
        return dist.group.WORLD
    return group


def group_store(group: Any = None) -> KeyValueStore:
    """The c10d store of ``group`` (default: the default group), namespaced to that group."""
    pg = _resolve(group)
    return cast(KeyValueStore, dist.distributed_c10d._get_process_group_store(pg))


def group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(_resolve(group)))


def _key(group: Any) -> str:
    return str(dist.distributed_c10d._get_process_group_name(_resolve(group)))


def start_heartbeat(group: Any = None, *, interval: float | None = None) -> Heartbeat:
    """Start (once per group and process) the thread that tells peers this process lives."""
    pg = _resolve(group)
    key = _key(pg)
    with _lock:
        beat = _heartbeats.get(key)
        if beat is None or not beat.alive:
            beat = Heartbeat(group_store(pg), HEARTBEAT_PREFIX, dist.get_rank(), interval)
            _heartbeats[key] = beat
        return beat


def stop_heartbeat(group: Any = None) -> None:
    """Stop this process's heartbeat for ``group`` (peers will then see it as gone)."""
    with _lock:
        beat = _heartbeats.pop(_key(group), None)
    if beat is not None:
        beat.stop()


@atexit.register
def _stop_all() -> None:
    with _lock:
        beats = list(_heartbeats.values())
        _heartbeats.clear()
    for beat in beats:
        beat.stop()


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
    pg = _resolve(group)
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace={namespace!r} must be a non-empty string")
    start_heartbeat(pg, interval=heartbeat_interval)
    me = dist.get_rank()
    store = group_store(pg)
    liveness = Liveness(
        store,
        HEARTBEAT_PREFIX,
        [r for r in group_ranks(pg) if r != me],
        interval=heartbeat_interval,
        timeout=heartbeat_timeout,
    )
    return FailureChannel(store, f"xgrad/failure/{namespace}", me, liveness)


def wait_work(
    work: Any,
    channel: FailureChannel | None,
    *,
    timeout: float | None = None,
    what: str,
    prefix: str = "",
) -> None:
    """Wait for a c10d ``Work`` (send, recv, collective), bounded and watching the channel.

    Args:
        work: the ``Work`` an async c10d call returned.
        channel: the step's failure channel (None: only the timeout bounds the wait).
        timeout: seconds (default ``XGRAD_TIMEOUT`` or 60).
        what: what is awaited, for the timeout's message (``"recv from rank 2"``).
        prefix: put before the failure's text in the raised message.

    Raises:
        xgrad.failure.RankError: a failure any rank posted, or a peer whose heartbeat
            stopped; ``RankUnresponsiveError`` when ``timeout`` ran out.
        RuntimeError: the work's own error, once it completed unsuccessfully.
    """
    seconds = check_seconds("timeout", default_seconds("timeout") if timeout is None else timeout)
    wait_until(work.is_completed, channel, timeout=seconds, what=what, prefix=prefix)
    work.wait()  # completed: returns at once, or raises the work's own error


def abort_group(group: Any = None) -> None:
    """Drop ``group`` after a fatal failure without waiting for its peers.

    Stops this process's heartbeat for it and aborts its backend (pending sends and
    receives are abandoned; NCCL communicators are aborted), then removes it like
    ``destroy_process_group`` does, which must not be called for it afterwards. With the
    default group, every group is dropped. Calling it for a group already gone does nothing.
    """
    pg = _resolve(group) if group is not None or dist.is_initialized() else None
    if pg is None:
        return
    if group is None or group == dist.group.WORLD:
        _stop_all()
    else:
        stop_heartbeat(pg)
    with contextlib.suppress(ValueError):  # already destroyed or aborted
        dist.distributed_c10d._abort_process_group(group)
