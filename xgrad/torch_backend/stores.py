"""The c10d store of a process group, and that store bounded when a rank hosts it.

Split from :mod:`.failure`: which store a failure channel talks to, and how it is
guarded (:class:`~xgrad.store_guard.GuardedStore`), is a question of its own.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import torch.distributed as dist

from xgrad.failure import KeyValueStore, check_seconds, default_seconds
from xgrad.store_guard import GuardedStore

__all__ = [
    "forget_guards",
    "group_key",
    "group_ranks",
    "group_store",
    "guarded_store",
    "resolve_group",
]

#: the bounded stores of the groups (:func:`guarded_store`), by group and timeout.
_guards: dict[tuple[str, float], GuardedStore] = {}
_lock = threading.Lock()


def resolve_group(group: Any) -> Any:
    """``group``, or the default group for None (an error when none was initialized)."""
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
    pg = resolve_group(group)
    return cast(KeyValueStore, dist.distributed_c10d._get_process_group_store(pg))


def group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(resolve_group(group)))


def group_key(group: Any) -> str:
    """``group``'s name, the same in every process: what per-group state is kept under."""
    return str(dist.distributed_c10d._get_process_group_name(resolve_group(group)))


def _hosted(store: Any) -> Any | None:
    """The ``TCPStore`` under ``store``'s prefixes, if it is one (a rank's process may host
    it); None for a store no rank serves (a file store)."""
    while store is not None and not isinstance(store, dist.TCPStore):
        store = getattr(store, "underlying_store", None)
    return store


def guarded_store(group: Any = None, *, timeout: float | None = None) -> KeyValueStore:
    """``group``'s store, every call bounded by ``timeout`` (default: the heartbeat timeout)
    when a process hosts it (:class:`~xgrad.store_guard.GuardedStore`); as it is otherwise.

    One guard per group and timeout, kept with the group's heartbeat. The host is taken
    to be global rank 0, which serves the ``TCPStore`` that ``init_process_group`` starts;
    under ``torchrun`` its agent does (``TORCHELASTIC_USE_AGENT_STORE``), and no rank is
    named.
    """
    pg = resolve_group(group)
    store = group_store(pg)
    hosted = _hosted(store)
    if hosted is None:
        return store
    seconds = check_seconds(
        "heartbeat_timeout", default_seconds("heartbeat_timeout") if timeout is None else timeout
    )
    key = (group_key(pg), seconds)
    with _lock:
        guard = _guards.get(key)
        if guard is None or guard.inner is not store:
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            guard = GuardedStore(
                store,
                timeout=seconds,
                me=dist.get_rank(),
                host=None if agent else 0,
                address=f"TCPStore {hosted.host}:{hosted.port}",
                gone=(dist.DistNetworkError,),
            )
            _guards[key] = guard
        return cast(KeyValueStore, guard)


def forget_guards(key: str | None = None) -> None:
    """Drop the guards of the group named ``key`` (every group's for None), as its
    heartbeat stops: a group made later under the same name gets its own."""
    with _lock:
        for k in [k for k in _guards if key is None or k[0] == key]:
            del _guards[k]
