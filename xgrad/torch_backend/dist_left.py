"""A rank that leaves a process group after its last context tells its peers so.

Contexts pair up across ranks by the order each rank opens them (:mod:`.dist_contexts`).
A rank that ran fewer contexts than its peers and then ended (its process exited, or it
destroyed the group) left them waiting in the next one for messages that never come, and
they named it as a rank that "stopped answering" (a heartbeat timeout later, or through
gloo's "Connection reset by peer"), or, after a ``destroy_process_group`` with its
heartbeat still beating, blamed the waiting rank itself. So, as it leaves, a rank posts on
the failure channel of the group's next context that it left after N contexts; the peers
waiting in that context raise it at their next poll of the channel.

Nothing is paid per context: the post is made once per group, on the way out, by the
hooks of :mod:`.leaving` (a wrapper of ``torch.distributed.destroy_process_group``, run
before the group's connections close, and an exit hook), asked for with the first
context. A rank killed or frozen runs neither and is still named by its heartbeat as one
that stopped answering.

A peer that catches that error and opens another context on the group would wait there
for the rank that left, and name it a heartbeat timeout later as one that stopped
answering. So a peer keeps the error per group as its context raises it
(:func:`remember`), and each later context it opens there raises it again at once
(:func:`refuse`): a dict lookup per context, no store read, and none at all on a group
where no rank left.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from xgrad.failure import FailureChannel, RankError
from xgrad.torch_backend.failure import CHANNEL_PREFIX, EXIT_WAIT, guarded_store
from xgrad.torch_backend.leaving import DESTROYED, EXITED, alive, every_group, how_left, on_leave

__all__ = ["DESTROYED", "EXITED", "context_namespace", "leave", "refuse", "remember", "watch"]


#: as this process leaves the group of a name: (contexts it opened there, the one it is
#: in or None) (:func:`.dist_contexts.leaving`).
Leaving = Callable[[str], tuple[int, int | None]]

#: group name -> (the group, this process's global rank, its contexts there: ``Leaving``).
_groups: dict[str, tuple[weakref.ref[Any], int, Leaving]] = {}
_lock = threading.Lock()
#: how a leave's post begins (:func:`_post`): after its last context, or inside one.
AFTER, INSIDE = "left after ", "left in distributed autograd context "
#: group name -> (the group, the error a context of it raised as a peer left it).
_gone: dict[str, tuple[weakref.ref[Any], RankError]] = {}


def context_namespace(seq: int) -> str:
    """The failure channel namespace of a group's context number ``seq``."""
    return f"dist_autograd/{seq}"


def watch(name: str, pg: Any, me: int, leaving: Leaving) -> None:
    """Remember that this process runs contexts on ``pg`` (named ``name``), to tell its
    peers when it leaves; asks for the leave hooks with the first group (:mod:`.leaving`).
    A lookup after that."""
    if name in _groups and _groups[name][0]() is pg:
        return
    with _lock:
        _groups[name] = (weakref.ref(pg), me, leaving)
    on_leave(_on_leave)


def _on_leave(group: Any, exiting: bool) -> None:
    leave(group, how_left(exiting))


def remember(name: str, pg: Any, error: BaseException) -> None:
    """As a context of ``pg`` (named ``name``) raises ``error``: kept if it is a peer's
    leave (:func:`_post`), for :func:`refuse`."""
    if not isinstance(error, RankError):
        return
    failure = error.failure
    left = failure.message.startswith((AFTER, INSIDE))
    if left and failure.kind == "unresponsive" and not failure.where:
        _gone[name] = (weakref.ref(pg), error)


def refuse(name: str, pg: Any, ids: Iterator[int]) -> None:
    """Before a context of ``pg`` (named ``name``) opens: raise the leave of a peer that
    an earlier context of it raised (:func:`remember`) again, at once, as the context's
    whose id it draws from ``ids`` (only then: the ids of the contexts that open stay
    consecutive): that peer never answers there. A dict lookup."""
    gone = _gone.get(name)
    if gone is None:
        return
    ref, error = gone
    if ref() is not pg:  # (a group of that name made since: a fresh start)
        _gone.pop(name, None)
        return
    again = copy.copy(error)  # (the kept one's traceback stays out of this one's)
    if hasattr(again, "context_id"):
        again.context_id = next(ids)
    raise again.with_traceback(None)


def leave(group: Any, how: str) -> None:
    """Post, for ``group`` (None or the default group: every group), that this process
    left it after its contexts (``how``: :data:`DESTROYED`, :data:`EXITED`). Never
    raises: a post that cannot be made leaves the peers to name this rank by its
    heartbeat, as they did before."""
    try:
        every = every_group(group)
        with _lock:
            names = [n for n, (ref, _, _) in _groups.items() if every or ref() is group]
            entries = [(n, _groups.pop(n)) for n in names]
        for name, (ref, me, leaving) in entries:
            pg = ref()
            if pg is not None and alive(pg):
                _post(pg, name, me, leaving, how)
    except Exception:  # leaving goes on; a store gone already answers nothing
        return


def _post(pg: Any, name: str, me: int, leaving: Leaving, how: str) -> None:
    """Post this rank's leave on the channel of the context its peers wait for it in."""
    count, inside = leaving(name)
    plural = "" if count == 1 else "s"
    if inside is None:
        at = count + 1
        message = (
            f"{AFTER}{count} distributed autograd context{plural} on process group "
            f"{name!r} ({how}): it never enters the group's context {at}, in which the "
            "other ranks wait for it (every rank of a group must open as many contexts "
            "as the others)"
        )
    else:
        at = inside
        message = f"{INSIDE}{at} on process group {name!r} ({how}) before that context was closed"
    store = guarded_store(pg, timeout=EXIT_WAIT)
    channel = FailureChannel(store, f"{CHANNEL_PREFIX}/{context_namespace(at)}", me)
    channel.post("", message, kind="unresponsive")
