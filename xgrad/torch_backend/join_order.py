"""Under xgrad's ``Join`` of several DDPs: a forward pass of another DDP before the first one's backward.

A rank that has joined shadows the DDPs of its join context one after another, each
one's forward pass and then the backward pass that may follow it (:mod:`.join_hook`),
and the first joinable's backward pass only once its round says one began
(:mod:`.join_rounds`). Where the ranks still training run the forward passes of two
DDPs before one backward pass (``d2(d1(x)).backward()``, or the sum of both losses
``(d1(x).sum() + d2(y).sum()).backward()``), the joined rank waits in the first DDP's
round, which those ranks enter only in the backward pass, while they wait in the second
DDP's forward pass for the joined rank's part of its announcement: each waits for the
other, to the DDP's timeout. PyTorch's ``Join([d1, d2])`` over its own DDPs cannot do it
either: its joined rank pairs the first DDP's bucket all-reduces with the second's
forward pass on the same group, and the ranks hang to gloo's timeout (or pair counts
with other one-element all-reduces and end at different points). Before any rank
joined, the passes go as outside ``join()`` (no shadow to match), as PyTorch's do.

So, once a rank has joined, a forward pass of a DDP of xgrad's ``Join`` other than the
first, while the first DDP's round is still open (its forward pass ran, its backward
did not begin), raises at once on every rank still training (:func:`refuse_second_forward`),
before the pass sends anything: the error is posted as the first DDP's step failure, its
part of the round sent (``FAIL``), and a note that it stops (:mod:`.join_leave`) ends the
joined ranks' wait in the round, where they raise the same error naming that rank. No
exact design is within reach: the joined rank cannot know, at the first DDP's forward
pass, whether another DDP's forward pass comes before its backward.

The same holds for DDPs whose forward passes run in another order than the context's
(``Join([d2, d1])`` with ``d1``'s forward pass first, each DDP's backward pass in
between): the joined rank counts, waiting for the first joinable's forward pass, while
the ranks still training wait for it in another DDP's (PyTorch's ``Join`` over its own
DDPs hangs to gloo's timeout; with even inputs both work, nobody shadowing anything).
The ranks still training cannot tell at that forward pass whether a rank has joined (the
first joinable's count says so, and comes later), so each such forward pass writes to
the store, in one key per context (:class:`JoinOrder`, deleted as the context ends), the
first joinable's step, what ran and that DDP's step before it (:func:`note_order`): a
joined rank whose count waits past a poll reads it (:func:`refuse_order`) and, when it
names the step it counts for and a pass of that DDP it has not shadowed, posts the refusal to that DDP's step, where the ranks still training wait, and
raises it; they send their part of its count as they leave ``join()``
(:func:`~.join_refused.left_refused`), so that no all-reduce is left pending on the join
group. A rank still training that catches either refusal inside the block and goes on
raises it again at each later pass, and as it leaves (:mod:`.join_refused`). With
even inputs such a context pays one store write per iteration and trains as PyTorch's.

Under PyTorch's ``Join`` over xgrad's DDPs none of this is seen (its context links
nothing): there the ranks still wait to the DDP's timeout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xgrad.failure import RankError
from xgrad.torch_backend.ddp_recover import start_forward
from xgrad.torch_backend.join_absent import stand_in_absent, stand_in_before
from xgrad.torch_backend.join_given_up import give_up_cut_short, linked, refuse_skipped
from xgrad.torch_backend.join_leave import post_left
from xgrad.torch_backend.join_refused import ORDER, left_refused, refuse_again, standing
from xgrad.torch_backend.join_rounds import stand_in

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = [
    "ORDER",
    "JoinOrder",
    "before_forward",
    "left_refused",
    "note_order",
    "refuse_order",
    "refuse_second_forward",
]

#: what the note of a rank that refused such a forward pass says.
STOPPED = "gave up the step: the ranks that had joined stop shadowing"


def refuse_second_forward(ddp: DistributedDataParallel) -> None:
    """Before ``ddp``'s forward pass under xgrad's ``Join``: raise if it is not the first
    joinable, some rank has joined, and the first joinable's forward pass has no backward
    pass yet (its round open); the joined ranks are told at once (see the module)."""
    config = ddp._join_config
    peers = ddp._join_peers
    if not config.enable or config.is_first_joinable or ddp._counted_config is not config:
        return
    first: Any = peers[0] if peers else None
    hooks, watch = getattr(first, "_grad_hooks", None), getattr(first, "_watch", None)
    if first is ddp or hooks is None or watch is None:  # (a Join takes any Joinable)
        return
    pending = hooks.join_round
    world = watch.world
    if pending is None or pending.training >= world:
        return
    rank = ddp._watch.channel.rank
    error = RuntimeError(
        f"join(): rank {rank} ran a forward pass of DDP {peers.index(ddp)} of the join context "
        f"(its joinables counted from 0) while DDP 0's forward pass had no backward pass "
        f"yet, with {world - pending.training} of the {world} ranks joined: those ranks "
        "shadow each DDP's forward pass and then its backward pass, and cannot shadow two "
        "forward passes before one backward (d2(d1(x)).backward(), or a sum of both "
        "losses; PyTorch's Join([d1, d2]) hangs there too). Run each DDP's backward pass "
        "before the next DDP's forward pass, or wrap the modules in one DDP"
    )
    posted = watch.post("join", error)  # DDP 0's step fails, where the joined ranks look
    if ddp._join_order is not None:  # and it stands here for the rest of the context
        ddp._join_order.refused = posted
    hooks.join_round = None
    pending.fail()  # this rank's part of DDP 0's round: the joined ranks' part meets it
    post_left(watch.channel, STOPPED)
    raise error


class JoinOrder:
    """The forward passes of one xgrad ``Join``'s DDPs, in the order they ran here.

    ``firsts``: the first joinable's forward passes so far; ``seen``: by joinable index,
    ``firsts`` at that DDP's last forward pass; ``wrong``: a DDP's forward pass came with
    none of the first's since its last (or before the first's first): each later one of
    a DDP other than the first is written too. ``key``: the store key (in the first
    joinable's step at the context's start, the same on every rank) that a forward pass
    out of order writes (:func:`note_order`).
    """

    def __init__(self, joinables: Sequence[Any], hooks: Sequence[Any] = ()) -> None:
        self.joinables = tuple(joinables)
        self.hooks = hooks  #: the context's join hooks
        for i, joinable in enumerate(self.joinables):  # (and refuse_second_forward's peers)
            if hasattr(joinable, "_join_peers"):
                joinable._join_peers = self.joinables
                joinable._join_order = self
                stand = functools.partial(stand_in, joinable) if i == 0 else None
                joinable._grad_hooks.stand_in = stand
        linked(self.joinables)  # a given-up no_sync pass gives up the iteration
        watch = getattr(joinables[0], "_watch", None) if joinables else None
        self.store = None if watch is None else watch.channel.store
        #: the namespace of the first joinable's step as the context began
        self.entered = "" if watch is None else watch.channel.prefix
        self.key = f"{self.entered}/join_order"
        self.firsts = 0
        self.seen: dict[int, int] = {}
        #: the ranks still training at the first joinable's last count (join_absent)
        self.training: int | None = None
        #: the joined ranks' hooks shadow the other DDPs after this rank's last count,
        #: whatever becomes of the first joinable's step (join_absent._joined)
        self.shadows_others = False
        self.wrong = False
        self.written = False
        #: the first joinable's step failed in the iteration a joined rank shadows: its
        #: other DDPs' hooks skip it (join_hook)
        self.failed = False
        #: the first joinable's hook shadowed a backward pass in this iteration: the hooks
        #: of the joinables that are not DDPs (an optimizer's) run (join_others)
        self.stepped = False
        #: the first failure a join hook kept, raised once every post hook ran
        self.kept: BaseException | None = None
        #: each joinable's step namespace as the context began, and the refusal that
        #: ended the context on this rank (join_refused)
        self.began = tuple(_prefix(j) for j in self.joinables)
        self.refused: RankError | None = None

    def refuse(self) -> None:
        """:func:`refuse_order`, for this context's joined rank (its hooks: the context's)."""
        refuse_order(self, self.hooks)

    def left_refused(self) -> None:
        """:func:`left_refused` of this context's DDPs (best effort: a group the user
        aborted in its handler takes no part)."""
        with contextlib.suppress(Exception):
            left_refused(self.joinables)

    def standing(self) -> RankError | None:
        """:func:`~.join_refused.standing`: the refusal that ended the context here."""
        return standing(self)

    def forget(self) -> None:
        """As the context ends: the key deleted, if this rank wrote it (best effort)."""
        if self.written and self.store is not None:
            self.written = False
            with contextlib.suppress(Exception):
                self.store.delete_key(self.key)


def _prefix(joinable: Any) -> str:
    watch = getattr(joinable, "_watch", None)
    return "" if watch is None else str(watch.channel.prefix)


def before_forward(ddp: DistributedDataParallel) -> None:
    """What ``join_order`` (and :mod:`.join_given_up`) checks before a DDP's forward pass
    under xgrad's ``Join``."""
    config = ddp._join_config
    if config.enable and ddp._counted_config is config:
        refuse_again(ddp)
        refuse_skipped(ddp)
        give_up_cut_short(ddp)
        note_order(ddp)
        refuse_second_forward(ddp)


def note_order(ddp: DistributedDataParallel) -> None:
    """A forward pass of a DDP other than the first joinable with no forward pass of the
    first since its last (or none yet): out of the context's order, and so is each such
    pass after it (``d1, d2, d1, d2``: the first joinable's count comes after ``d1``'s
    pass each iteration); written to the store (the first joinable's step, this rank,
    this DDP's index, its step before the one this pass is in) for a joined rank. Each later pass is
    written even where the order was wrong once only (``d2`` under ``torch.no_grad()``
    first): the forward passes alone cannot tell the two apart; the joined rank does, by
    that DDP's step (a pass it shadowed already is not waited in)."""
    order: JoinOrder | None = ddp._join_order
    if order is None or order.store is None or ddp not in order.joinables:
        return
    index = order.joinables.index(ddp)
    if index == 0:
        stand_in_absent(order)  # the later DDPs that ran no pass since its last
        order.firsts += 1
        return
    stand_in_before(order, index)  # (a rank joined: the passes of the cycle before it)
    if order.seen.get(index, 0) == order.firsts:  # (none of the first's yet: from the start)
        order.wrong = True
    if order.wrong:
        first = order.joinables[0]
        rank = ddp._watch.channel.rank
        # The step before the one this pass is in: a pass that goes on with a step
        # begun by a no_sync pass (a synchronised one after accumulating) is in the same
        # step as that pass, which a joined rank that ran both has ended already.
        own = ddp._watch.step - int(ddp._grad_hooks.accumulating)
        order.store.set(order.key, f"{first._watch.step} {rank} {index} {own}")
        order.written = True
    order.seen[index] = order.firsts


def refuse_order(order: JoinOrder, hooks: Sequence[Any]) -> None:
    """A joined rank whose count waits: if a rank still training ran another DDP's
    forward pass before the first joinable's in the step this rank counts for, post the
    refusal to that DDP's step (begun here, as there, unless its hook in ``hooks`` began
    it already) and raise it."""
    if order.store is None or not order.store.check([order.key]):
        return
    step, rank, index, own = (int(v) for v in order.store.get(order.key).split())
    if step != order.joinables[0]._watch.step:
        return  # an earlier iteration's, with no rank joined
    ddp = order.joinables[index]
    hook = next((h for h in hooks if getattr(h, "ddp", None) is ddp), None)
    if own != ddp._watch.step - int(hook is not None and hook.begun):
        # A pass of that DDP this rank shadowed already (in order, after the first's
        # forward pass: a forward pass out of order once, earlier, keeps each later one
        # written), not one the ranks still training wait in now.
        return
    error = RuntimeError(
        f"join(): rank {rank} ran DDP {index}'s forward pass before DDP 0's in an iteration "
        "(the join context's joinables counted from 0) while a rank had joined: a rank "
        "that has joined shadows the DDPs in the context's order, the first one's forward "
        "pass first (it counts the ranks still training). List the DDPs in the order "
        "their forward passes run (Join([d1, d2]) where d1's runs first), or wrap the "
        "modules in one DDP (PyTorch's Join hangs there too)"
    )
    if hook is not None and hook.begun:
        hook.begun = False
    else:
        start_forward(ddp._watch, ddp._grad_hooks, True, joining=True)
    raise ddp._watch.post(ORDER, error)
