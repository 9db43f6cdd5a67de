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
in the failed step, to the most ``no_sync`` passes a peer made in the failed step. Each
rank posts its count in the failed step's namespace as it begins the next step (one
store write per rank and failed step, nothing on a good step). As many: the pass is the
failed step's synchronised one, and raises its failure (the step begun at the
``no_sync`` pass stays begun, its count restarted, so the next step's passes are counted
from its first). Else the next step's (a ``try`` per step makes more; every rank failing
in the step, each fewer).

Two loops are misread: a ``try`` per step whose next step has exactly as many
micro-batches fewer than the failed one as this rank made in it (four micro-batches, the
first failing, then a step of three), and a ``try`` per micro-batch that also skipped a
micro-batch before it reached the DDP. The peers' counts are read at a wait bounded by
the DDP's timeout and watching the step's channel; the failed step's namespace is kept
until this rank read them (its read mark, :mod:`.ddp_leftovers`, is written then). A
``try`` per micro-batch whose failed step is the loop's last still waits at its next
``no_sync`` pass, which begins the next step with its fresh group, for peers that begin
none (to the timeout, or until their heartbeat stops, naming one; as before this
module).

Not under ``join()``, whose rounds say which pass the peers run (:mod:`.join_rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xgrad.failure import Failure, error_for
from xgrad.failure_wait import wait_until
from xgrad.torch_backend.ddp_leftovers import counts_keys, mark_read

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = ["GivenUp", "defer", "post_count", "release", "settle"]


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


def post_count(watch: StepWatch) -> None:
    """This rank's ``no_sync`` passes in the step its channel is of, which failed: there
    (deleted with the step's other keys, :mod:`.ddp_leftovers`)."""
    channel = watch.channel
    key = counts_keys(channel.prefix, [channel.rank])[0]
    channel.store.set(key, str(watch.nosync_passes).encode())


def defer(watch: StepWatch, hooks: GradientHooks, failure: Failure) -> None:
    """A ``no_sync`` pass after the one that gave the step up: which step it is in is
    settled at the next synchronised pass (:func:`settle`). Called before the pass begins
    the next step, so the channel is still the failed step's; that beginning leaves the
    step's read mark to :func:`settle` (its ``hold_read``)."""
    if hooks.given_up_step is not None:  # an earlier one, never settled: superseded
        release(watch, hooks)
    hooks.given_up_step = GivenUp(failure, watch.nosync_passes, watch.channel.prefix)


def release(watch: StepWatch, hooks: GradientHooks) -> None:
    """Forget the deferred step (``join()`` places the passes, or a later step was given
    up), marking its namespace read."""
    given_up, hooks.given_up_step = hooks.given_up_step, None
    if given_up is not None:
        mark_read(watch, given_up.prefix)


def settle(watch: StepWatch, hooks: GradientHooks) -> None:
    """At a synchronised pass after a deferred one: raise the failed step's failure if this
    pass is that step's (this rank's ``no_sync`` passes of it as many as the most any
    peer made), else go on (the next step's pass)."""
    given_up, hooks.given_up_step = hooks.given_up_step, None
    assert given_up is not None
    try:
        mine = given_up.passes + watch.nosync_passes
        if mine == _most(watch, given_up.prefix):
            watch.nosync_passes = 0  # the next step's passes are counted from its first
            raise error_for(given_up.failure, watch.channel.rank)
    finally:
        mark_read(watch, given_up.prefix)


def _most(watch: StepWatch, prefix: str) -> int:
    """The most ``no_sync`` passes a peer made in the failed step (-1 with no peer: one
    rank has no peer's step to pair with, and the pass trains as before)."""
    store = watch.channel.store
    me = watch.channel.rank
    peers = [r for r in watch.ranks if r != me]
    if not peers:
        return -1
    keys = counts_keys(prefix, peers)
    wait_until(
        lambda: store.check(keys),
        watch.channel,
        timeout=watch.timeout,
        what="the other ranks' number of no_sync passes in the step given up here",
        peers=lambda: [r for r, k in zip(peers, keys, strict=True) if not store.check([k])],
    )
    return max(int(store.get(key).decode()) for key in keys)
