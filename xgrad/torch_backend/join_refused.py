"""Under xgrad's ``Join``: a refusal that ended the context stands on a rank that catches it.

Two refusals of :mod:`.join_order` end a join context of several DDPs once a rank has
joined: a forward pass of another DDP before the first one's backward
(:func:`~.join_order.refuse_second_forward`), and forward passes out of the context's
order (:func:`~.join_order.refuse_order`, posted by the joined rank). The joined ranks
raise it and leave ``join()``; a rank still training that raises it out of its block
sends what they left pending (:func:`left_refused`). One that catches it inside the
block (a ``try`` per iteration) and goes on ran its next pass against ranks that were
gone, and, at the end of its block, counted with them: its part of their count never
sent, it waited to the DDP's timeout (and the next join context paired its count with
that one). So the refusal stands on that rank for the rest of the context
(:func:`standing`, no lookup: the channel's failure as this rank read it): each later
forward pass of the context's DDPs raises it again before it sends anything
(:func:`refuse_again`), and leaving the block without an exception is leaving it
raising the refusal (:class:`~.join.Join`), the count's part sent then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xgrad.failure import RankError, error_for
from xgrad.torch_backend.join_announce import count, sum_async

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["ORDER", "again", "left_refused", "refuse_again", "standing"]

#: where the refusal of DDPs forwarded out of the context's order is posted.
ORDER = "join order"


def standing(order: Any) -> RankError | None:
    """The refusal that ended ``order``'s context (a :class:`~.join_order.JoinOrder`) on
    this rank, if it raised one: its own (``order.refused``), or one a joined rank posted
    to a step one of the DDPs began in this context and this rank read (no lookup)."""
    if order.refused is not None:
        return order.refused  # type: ignore[no-any-return]
    for joinable, began in zip(order.joinables, order.began, strict=True):
        watch = getattr(joinable, "_watch", None)
        if watch is None:
            continue
        failure = watch.channel.seen()
        if failure is not None and failure.where == ORDER and watch.channel.prefix != began:
            order.refused = watch.naming_others(error_for(failure, watch.channel.rank))
            return order.refused  # type: ignore[no-any-return]
    return None


def again(error: RankError) -> RankError:
    """A fresh copy of ``error`` to raise (not the one raised before, whose traceback grows)."""
    return type(error)(error.failure, error.raised_on, error.prefix, error.also)


def refuse_again(ddp: DistributedDataParallel) -> None:
    """Before ``ddp``'s forward pass: the refusal that ended its context here, if any,
    raised again (the joined ranks are gone: nothing is sent)."""
    order = ddp._join_order
    if order is None:
        return
    refusal = standing(order)
    if refusal is not None:
        raise again(refusal)


def left_refused(joinables: Sequence[Any]) -> None:
    """A rank still training that leaves xgrad's ``Join`` raising the refusal of
    :func:`~.join_order.refuse_order`: its part of the joined ranks' count, which waited
    for the first joinable's forward pass (not waited for)."""
    first = joinables[0] if joinables else None
    if first is None or not hasattr(first, "_join_order"):
        return
    for ddp in joinables:
        failure = ddp._watch.channel.poll() if hasattr(ddp, "_watch") else None
        if failure is not None and failure.where == ORDER:
            if failure.rank != first._watch.channel.rank:  # (the joined rank posted it)
                sum_async(first.process_group, count(first, 0.0))
            return
