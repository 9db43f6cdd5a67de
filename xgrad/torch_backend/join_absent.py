"""Under xgrad's ``Join`` of several DDPs: a later DDP that runs no pass between two of the first's.

A rank that has joined shadows, per count (the first joinable's forward pass), one pass
of each DDP of the context in turn (:mod:`.join_hook`). Where the ranks still training
run the first DDP's forward pass again before another DDP ran one (gradient
accumulation in ``d1`` only: ``d1``'s ``no_sync`` pass, then its synchronised one, then
``d2``'s; or all of ``d1``'s passes before ``d2``'s), the joined rank waited in that
DDP's announcement while they waited in the first DDP's count: every rank timed out
(PyTorch's ``Join([d1, d2])`` over its own DDPs pairs the count with the other DDP's
collectives there, and gloo aborts the processes).

The same the other way round: ``d2``'s pass again before ``d1`` ran one (``d2``
accumulating alone, or all of ``d1``'s passes of a step before ``d2``'s): the joined rank
counted while the ranks still training waited in ``d2``'s announcement; the join order
refused it (:mod:`.join_order`), where it can now go on.

So, once a rank has joined (the first DDP's last count said so), each rank still training
stands in, at the first DDP's forward pass, for the pass of each later DDP that ran none
since the first DDP's last one (:func:`stand_in_absent`): what that DDP's forward pass
would send before its module runs when no backward pass follows (a buffer sync that is
due, an announcement saying "under ``torch.no_grad()``", its buffer flag unchanged), read
at once. The joined rank's hook meets it and returns, as for an evaluation pass, and
counts with the first DDP's pass. Nothing of that DDP's step changes, on either side:
its next real pass goes on as if none had been stood in for. Likewise, at another DDP's
forward pass that comes again before the first's, they stand in for the first DDP's
pass (its count, saying "under ``torch.no_grad()``") and for the DDPs between
(:func:`stand_in_before`): the joined rank counts, shadows those as evaluation passes,
and meets this pass in its DDP's hook. With three DDPs or more, each pass fills the
joined rank's cycle up to its own place: the DDPs before it that ran none since the
first's pass (``d1, d3`` with ``d2`` skipped), and, where it comes again, the DDPs after
it before the first's count; a rank that leaves the loop fills its last iteration's
cycle before it counts (``Join.__exit__``: ``d3`` skipped in that iteration, which the
ranks still training stand in for). A stood-in buffer sync sends the broadcast into
copies, thrown away (:func:`~.ddp_buffers.sync_buffers`): the DDP ran no pass, and a
rank may join before its next real one, whose broadcast comes from the highest rank
still training then, from its own buffers (PyTorch's ``_find_common_rank``).
An iteration whose first DDP's synchronised step failed is skipped by every rank's hooks
alike: no stand-in there. One that failed in a ``no_sync`` pass of the first DDP is not
(the joined ranks shadow the other DDPs after that pass's count): the ranks still
training stand in as above, the failing rank too, at its next pass of the first DDP
(:mod:`.join_given_up` stands in at once only for a DDP that accumulates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xgrad.torch_backend.ddp_buffers import first_pass_regrouped, sync_buffers
from xgrad.torch_backend.ddp_recover import start_forward
from xgrad.torch_backend.join_leave import training_gate
from xgrad.torch_backend.join_notify import notify_join_context
from xgrad.torch_backend.join_rounds import announce, read_announcement
from xgrad.torch_backend.join_settle import settle_next

if TYPE_CHECKING:
    from xgrad.torch_backend.join_order import JoinOrder

__all__ = ["rank_joined", "stand_in_absent", "stand_in_before"]


def rank_joined(order: JoinOrder | None) -> bool:
    """Whether a rank had joined at the first joinable's last count (so is in the hooks)."""
    if order is None or order.training is None:
        return False
    return order.training < order.joinables[0]._watch.world


def _joined(order: JoinOrder) -> bool:
    """:func:`rank_joined`, and the joined ranks' hooks shadowed the other DDPs after the
    first joinable's last count: they do unless that count was a synchronised pass's and
    its step failed (they learn it in that pass's round or backward pass, and skip the
    rest of the iteration, as the ranks still training do: :mod:`.join_given_up`), or it
    met a peer's stand-in for a given-up step (they count again at once). After any other
    count (a ``no_sync`` pass's) they learn nothing more and shadow the others' passes,
    though the step failed since (a rank whose ``no_sync`` pass raised, its peers that
    heard of it before their next pass): every rank still training stands in for them
    alike, whatever it knows of the failure (``JoinOrder.shadows_others``; knowing it or
    not was a race, and the ranks stood in on some ranks and not on others)."""
    if not rank_joined(order):
        return False
    return order.shadows_others or order.joinables[0]._watch.channel.poll() is None


def stand_in_absent(order: JoinOrder, start: int = 1, stop: int | None = None) -> None:
    """With a rank joined at the first joinable's last count: stand in for the pass of
    each DDP with an index from ``start`` to ``stop`` (exclusive; default: the last) that
    ran none since that count, in the context's order (the joined rank's hooks')."""
    if _joined(order):
        _stand_in(order, start, stop)


def _stand_in(order: JoinOrder, start: int = 1, stop: int | None = None) -> None:
    """:func:`stand_in_absent` once :func:`_joined` said so (a store lookup: asked once
    per pass; and one for each DDP stood in for, whose last step may have failed)."""
    for index, ddp in enumerate(order.joinables[start:stop], start):
        if order.seen.get(index, 0) >= order.firsts or not hasattr(ddp, "_grad_hooks"):
            continue
        if ddp._announcing is not None or ddp._watch.deferred is not None:
            settle_next(ddp)  # its last pass raised before reading them
        if ddp._watch.channel.poll() is not None:
            # Its last step failed (its pass of the iteration before raised on a rank):
            # the stand-in begins the next, with its fresh group, as that DDP's next pass
            # of any kind would under join() (ddp_recover.start_forward), and as the
            # joined rank begins it (join_failed); else it waited for the group's marks
            # while this rank sent the announcement on the failed group.
            start_forward(ddp._watch, ddp._grad_hooks, False, True, gate=training_gate(ddp))
            first_pass_regrouped(ddp)
        if ddp._check_sync_bufs_pre_fwd():
            sync_buffers(ddp, discard=True)
        announce(ddp, False, False, ddp.require_forward_param_sync)
        read_announcement(ddp)
        order.seen[index] = order.firsts


def stand_in_before(order: JoinOrder, index: int) -> None:
    """Before the forward pass of DDP ``index`` (not the first), with a rank joined:
    fill the joined rank's cycle up to this DDP's place in it. When this DDP ran a pass
    since the first joinable's last one (``d2``'s passes of a step all after ``d1``'s),
    stand in for the DDPs after it that ran none, then for the first's pass (its count,
    as a forward pass under ``torch.no_grad()`` sends it, its buffer flag unchanged);
    then for the DDPs before it that ran none since (``d1, d3`` with ``d2`` skipped)."""
    if order.firsts == 0 or not _joined(order):
        return
    if order.seen.get(index, 0) == order.firsts:
        _stand_in(order, start=index + 1)
        _stand_in_first(order)
    _stand_in(order, stop=index)


def _stand_in_first(order: JoinOrder) -> None:
    first: Any = order.joinables[0]
    if first._announcing is not None or first._watch.deferred is not None:
        settle_next(first)
    notify_join_context(first, (False, False, first.require_forward_param_sync))
    if first._check_sync_bufs_pre_fwd():
        sync_buffers(first, discard=True)
    read_announcement(first)
    order.firsts += 1
