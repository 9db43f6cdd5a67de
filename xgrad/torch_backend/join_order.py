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
Under PyTorch's ``Join`` over xgrad's DDPs this is not seen (its context links nothing):
there the ranks still wait to the DDP's timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xgrad.torch_backend.join_leave import post_left

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["refuse_second_forward"]

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
    watch.post("join", error)  # DDP 0's step fails, where the joined ranks look
    hooks.join_round = None
    pending.fail()  # this rank's part of DDP 0's round: the joined ranks' part meets it
    post_left(watch.channel, STOPPED)
    raise error
