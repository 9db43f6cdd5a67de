"""A DDP pass left unfinished on a rank that leaves its group: posted as it leaves.

A backward pass that raised is posted to its step's failure channel at the rank's next
forward pass (:mod:`.ddp_unfinished`), a synchronised one outside ``join()`` as the
exception leaves autograd (:mod:`.ddp_cut_short`), and under xgrad's ``join()`` as the
rank joins or leaves the context (:mod:`.join`). A rank with no forward pass after it
whose process then ended (the exception uncaught, or caught by a loop that stops there)
left its peers waiting in the step's synchronised pass until its connections closed, and
they named it as one that "stopped answering", not its exception. That was the case of a
``no_sync`` pass (its post gives up the step the peers still accumulate for, so it waits
for the next pass, which tells what the loop does next: :mod:`.ddp_which_step`), of any
pass under PyTorch's own ``Join`` (none of xgrad's hooks runs as it is left), and of a
DDP collected with its step under way (:data:`~.ddp_unfinished.DROPPED`).

So, as the process destroys the pass's group or ends (:mod:`.leaving`'s hooks, asked for
with the first DDP's, which run before the group's connections close and before the
heartbeats stop, so a peer whose transfer fails then finds the post), what is left is
posted, as :func:`.ddp_recover.start_forward` would have. It never raises: a group
destroyed or aborted already is skipped (its peers were told then, or gave up on it),
each store call is bounded (two seconds, as :mod:`.dist_left`'s), and a store gone already answers
nothing (the peers then name this rank by its heartbeat, as before). Nothing is paid per
step. A rank killed or frozen runs no hook and is still named by its heartbeat.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch.distributed as dist

from xgrad.torch_backend.ddp_give_up import give_up_cut_short_pass
from xgrad.torch_backend.ddp_unfinished import UNFINISHED, post_dropped, post_failed_pass
from xgrad.torch_backend.failure import EXIT_WAIT, guarded_store
from xgrad.torch_backend.leaving import on_leave

__all__ = ["install", "post_left_unfinished"]


def install() -> None:
    """Post what this process's DDPs leave unfinished as it leaves their groups (a
    lookup after the first call)."""
    on_leave(post_left_unfinished)


def post_left_unfinished(group: Any = None, exiting: bool = True) -> None:
    """This process leaves ``group`` (``None``: every group) and runs no forward pass
    there any more: each DDP pass of it left unfinished is posted to its step's failure
    channel (and, as it ends, each dropped DDP's step). ``exiting``: :data:`.leaving.Leave`'s."""
    every = group is None or group == dist.group.WORLD
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (give_up_cut_short_pass's: no one reads it now)
        if exiting:
            post_dropped()
        for hooks in list(UNFINISHED):
            watch = getattr(hooks, "watch", None)
            if watch is None or not (every or watch.user_group is group):
                continue
            if not _alive(watch.user_group):
                continue
            with contextlib.suppress(Exception):
                # bounded as :mod:`.dist_left`'s post: a store host frozen holds no exit long
                watch.channel.store = guarded_store(watch.user_group, timeout=EXIT_WAIT)
                if hooks.nosync_open:
                    give_up_cut_short_pass(watch, hooks)
                elif hooks.finalize_queued:
                    post_failed_pass(hooks, watch)


def _alive(group: Any) -> bool:
    """Whether c10d still knows ``group`` (``None``: the default group): not destroyed,
    not aborted."""
    try:
        if group is None:
            return dist.is_initialized()
        return group in dist.distributed_c10d._world.pg_map
    except (AttributeError, TypeError, RuntimeError):
        return False
