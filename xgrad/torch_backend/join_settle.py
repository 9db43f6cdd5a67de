"""Under ``join()``: what a pass left unread, settled before the next, and a round left behind.

A pass reads its announcement after the module ran and its round at the first wait for
a bucket (:mod:`.join_rounds`); one that raised first leaves them to the next forward
pass (:func:`settle_next`), or to the rank's leaving ``join()`` (:func:`left`). Where that
pass failed here, its step's failure is not raised again from the round: the step is
dropped as the next begins (a rank whose backward pass raised before it read its round
raised the step's failure twice, once at that forward pass, which then began no step,
and was a step behind the others from there on). A rank that left ``join()`` in a round
where everyone had left owes the joined ranks one more count (:func:`close_round`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xgrad.failure import RankError
from xgrad.torch_backend.ddp_watched import run_deferred
from xgrad.torch_backend.join_rounds import on_join_group, read_announcement

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["close_round", "left", "settle", "settle_next"]


def settle(ddp: DistributedDataParallel, failed: bool = False) -> None:
    """What a pass left unread (it raised before its end): the round, the announcement.
    ``failed``: that pass failed here (it raised, or left buckets unreduced, raised at
    this forward pass): the step's failure, posted meanwhile, is not raised from the
    round (see the module)."""
    try:
        run_deferred(ddp._watch)
    except RankError as error:
        if not failed or error.failure != ddp._watch.channel.poll():
            raise
    read_announcement(ddp)


def settle_next(ddp: DistributedDataParallel) -> None:
    """:func:`settle` at a forward pass, where the last pass may have failed here: raised
    part-way (its end never ran), or left buckets unreduced (raised at this pass)."""
    hooks = ddp._grad_hooks
    cut_short = hooks.finalize_queued and torch._C._current_graph_task_id() == -1
    settle(ddp, failed=cut_short or hooks.unfinished is not None)


def left(ddp: DistributedDataParallel) -> None:
    """A joined rank, before shadowing a pass: its own last pass settled, its round (if
    it left ``join()`` in one) given up: its count was its part of it."""
    settle(ddp)
    ddp._grad_hooks.join_round = None


def close_round(ddp: DistributedDataParallel) -> None:
    """A rank that left ``join()`` in a round where everyone had left: the joined ranks
    count once more after the round; this is this rank's part of that count."""
    settle(ddp)
    if ddp._grad_hooks.join_round is not None:
        ddp._grad_hooks.join_round = None
        on_join_group(ddp, 0.0, "join, counting the ranks still training")
