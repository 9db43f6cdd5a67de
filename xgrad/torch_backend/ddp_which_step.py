"""Which step a synchronised pass belongs to, on a rank that gave a step up in a ``no_sync`` pass.

A rank whose ``no_sync`` pass raised (its forward, or its backward cut short) gives up the
step it accumulated for (:func:`~.ddp_give_up.abandon_step`); its peers go on with that
step's remaining micro-batches and raise the failure at its synchronised pass. What this
rank runs next depends on the user's loop, which the DDP cannot see: a ``try`` per step
goes on with the next step's first micro-batch, a ``try`` per micro-batch with the failed
step's next one. When the next pass is the synchronised one, it is the failed step's
(:func:`~.ddp_recover.start_forward` raises the failure there). When it is another
``no_sync`` pass, both loops look alike until the next synchronised pass: taken for the
next step's (as before this module), a loop with a ``try`` per micro-batch and two or
more ``no_sync`` passes after the failure had its steps paired with the peers' next ones
from there on, silently wrong gradients on every rank.

So such a pass is counted, not judged: the rank begins the next step there as before
(its fresh group is made with the peers' at their next step's first pass), counts its
``no_sync`` passes until its next synchronised one, and compares them, with those it made
in the failed step, to the number of ``no_sync`` passes the peers made in the failed step
(each rank posts its count in the failed step's namespace as it begins the next: one
store write per rank and failed step, nothing on a good step). No more than the peers'
largest count: the pass is the failed step's, and raises its failure (the step begun at
the ``no_sync`` pass stays begun, its count restarted, so the next step's passes are
counted from its first). More: the pass is the next step's. A loop whose next step has
fewer micro-batches than the failed step had after its failure could be misread. The
peers' counts are read only here, at a wait bounded by the DDP's timeout (a peer posts
its count at its next step's first forward pass, right after the failed step's
synchronised pass raised there); a failure of the next step posted meanwhile is raised
from the wait (the failed step's keys may then be deleted before this rank read them).

Not under ``join()``, whose rounds say which pass the peers run (:mod:`.join_rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xgrad.failure import Failure, error_for
from xgrad.failure_wait import wait_until

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = ["GivenUp", "counts_keys", "defer", "post_count", "settle"]


@dataclass(frozen=True)
class GivenUp:
    """A step given up in a ``no_sync`` pass, whose remaining passes this rank may still run.

    Args:
        failure: the step's failure (raised again at its synchronised pass).
        passes: this rank's ``no_sync`` passes of that step, the one that raised included.
        prefix: the step's namespace, where every rank posts its count.
    """

    failure: Failure
    passes: int
    prefix: str


def counts_keys(prefix: str, ranks: list[int]) -> list[str]:
    """The keys of the ranks' ``no_sync`` pass counts in a failed step's namespace."""
    return [f"{prefix}/passes/{r}" for r in ranks]


def post_count(watch: StepWatch, hooks: GradientHooks) -> None:
    """As this rank begins the step after a failed one: its ``no_sync`` passes in the failed
    step, in that step's namespace (deleted with its other keys, :mod:`.ddp_leftovers`)."""
    channel = watch.channel
    channel.store.set(f"{channel.prefix}/passes/{channel.rank}", str(hooks.nosync_passes).encode())


def defer(watch: StepWatch, hooks: GradientHooks, failure: Failure) -> None:
    """A ``no_sync`` pass after the one that gave the step up: which step it is in is
    settled at the next synchronised pass (:func:`settle`). Called before the pass begins
    the next step, so the channel is still the failed step's."""
    hooks.given_up_step = GivenUp(failure, hooks.nosync_passes, watch.channel.prefix)


def settle(watch: StepWatch, hooks: GradientHooks) -> None:
    """At a synchronised pass after a deferred one: raise the failed step's failure if this
    pass is that step's (this rank's ``no_sync`` passes of it no more than the most any
    peer made), else go on (the next step's pass)."""
    given_up, hooks.given_up_step = hooks.given_up_step, None
    assert given_up is not None
    store = watch.channel.store
    me = watch.channel.rank
    peers = [r for r in watch.ranks if r != me]
    if not peers:
        return  # one rank: no step of a peer to pair with, the pass trains as before
    keys = counts_keys(given_up.prefix, peers)
    wait_until(
        lambda: store.check(keys),
        watch.channel,
        timeout=watch.timeout,
        what="the other ranks' number of no_sync passes in the step given up here",
        peers=lambda: [r for r, k in zip(peers, keys, strict=True) if not store.check([k])],
    )
    most = max(int(store.get(key).decode()) for key in keys)
    if given_up.passes + hooks.nosync_passes <= most:
        hooks.nosync_passes = 0  # the next step's passes are counted from its first
        raise error_for(given_up.failure, me)
