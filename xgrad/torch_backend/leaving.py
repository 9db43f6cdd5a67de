"""What this process does as it leaves its process groups: told to its peers first.

A rank that leaves while its peers still wait for it (in a distributed autograd context
it never enters, :mod:`.dist_left`; in a DDP step whose backward pass it cut short,
:mod:`.ddp_exit`) posts why on the failure channel before its connections close, so
that they raise its words rather than name it as one that "stopped answering". It leaves
two ways, each hooked once per process by the first module that asks (:func:`on_leave`):

* ``torch.distributed.destroy_process_group``, wrapped: the hooks run before the group's
  connections close (a peer's transfer that fails then finds the post). Code that
  imported the function by name before the first hook was asked for gets the exit hook
  only.
* the process's end: a multiprocessing finalizer, which runs at a normal interpreter exit
  and where a multiprocessing child ends with ``os._exit`` (which skips ``atexit``),
  before the heartbeats stop.

A rank killed or frozen runs neither and is still named by its heartbeat. Nothing is paid
per step or context: the hooks run once, on the way out.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.util
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["DESTROYED", "EXITED", "Leave", "alive", "every_group", "how_left", "on_leave"]

#: how a rank left, as the posts word it.
DESTROYED = "it destroyed the group with destroy_process_group"
EXITED = "its process ended"

#: a hook run as this process leaves ``group`` (``None``: every group), ``exiting``: its
#: process ends (else it destroys the group).
Leave = Callable[[Any, bool], None]

_hooks: list[Leave] = []
_lock = threading.Lock()
_installed = False


def on_leave(hook: Leave) -> None:
    """Run ``hook`` as this process destroys a group or ends (once per hook); installs
    the wrapper and the finalizer with the first hook."""
    global _installed
    with _lock:
        if hook in _hooks:
            return
        _hooks.append(hook)
        if _installed:
            return
        _installed = True
    _wrap_destroy()
    multiprocessing.util.Finalize(None, _leave, args=(None, True), exitpriority=0)


def how_left(exiting: bool) -> str:
    """How a rank left, for its post: :data:`EXITED` or :data:`DESTROYED`."""
    return EXITED if exiting else DESTROYED


def every_group(group: Any) -> bool:
    """Whether leaving ``group`` (a hook's argument) leaves every group: ``None`` (the
    process ends) or the default group (destroying it destroys them all)."""
    return group is None or group == dist.group.WORLD


def alive(group: Any) -> bool:
    """Whether c10d still knows ``group`` (``None``: the default group): not destroyed,
    not aborted by ``abort_group``. A hook posts nothing on a group that is gone."""
    try:
        if group is None:
            return dist.is_initialized()
        return group in dist.distributed_c10d._world.pg_map
    except (AttributeError, TypeError, RuntimeError):
        return False


def _leave(group: Any, exiting: bool) -> None:
    """Every hook, in the order asked for; one that raises stops none of the others."""
    for hook in list(_hooks):
        with contextlib.suppress(Exception):
            hook(group, exiting)


def _wrap_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` run the hooks first."""
    c10d = dist.distributed_c10d
    real = c10d.destroy_process_group

    @functools.wraps(real)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        _leave(args[0] if args else kwargs.get("group"), False)
        return real(*args, **kwargs)

    for module in (dist, c10d):
        if getattr(module, "destroy_process_group", None) is real:
            module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
