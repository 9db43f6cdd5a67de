"""A synchronised step whose backward pass never reached DDP on some ranks, named.

A rank whose backward pass raises before any of DDP's gradient hooks ran (a hook on the
loss, a custom ``Function`` above the model), or that leaves the backward out, has
nothing of that step to reduce. DDP cannot tell it from a forward pass run for its
output only (a validation loss with gradients on), which is legal when every rank does
it; nor from one rank's extra forward pass with gradients on, which the others did not
run (it is named the same way, with the advice to evaluate under ``torch.no_grad()``).
Its peers, meanwhile, wait for its buckets; left alone, its next step's buckets would
complete theirs, and every later step would reduce one rank's step with another's,
silently (PyTorch's DDP does that). So at its next forward pass such a rank says so in
the step's namespace of the failure channel and waits, bounded, until

* every rank said the same (nobody reduced anything: go on, nothing to report; the
  reducer stays prepared, as PyTorch's, and reduces the next backward pass even under
  ``no_sync``: :func:`~.ddp_recover.reduces_unsynced`), or
* a failure is posted: a peer waiting in that step's reduction saw the notice while it
  polled the channel and posted a failure with this rank as its origin ("rank 1 in
  backward: its backward pass of this step never reached DDP ..."). That peer raises
  it; every rank then moves to a fresh private group at the same forward pass, as after
  any failed step (:mod:`.ddp_recover`), so the steps line up again.

A good step pays nothing on its way: the notice is looked for only by a wait that
already polls the channel (one more store lookup per poll, every 20 ms of a wait past
its spin). A step every rank skipped pays one store round per rank and a wait for the
slowest; its keys are deleted by the lowest rank two steps later, when every rank is
known to have left the wait (a later step's reduction or skip round needed them all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xgrad.failure import FailureChannel, RankError, error_for
from xgrad.failure_wait import wait_until

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch

__all__ = ["MESSAGE", "check_skipped", "drop_old_skips", "settle_skipped"]

#: what a peer waiting in the step's reduction posts, with the skipping rank as origin.
MESSAGE = (
    "its backward pass of this step never reached DDP (it raised before any gradient "
    "hook ran, or was not called, or this rank ran a forward pass with gradients on that "
    "the others did not: run evaluation under torch.no_grad()) while rank {waiter} "
    "reduced its gradients"
)


def _key(channel: FailureChannel, ticket: int) -> str:
    return f"{channel.prefix}/skipped/{ticket}"


def settle_skipped(watch: StepWatch) -> None:
    """At a forward pass after a synchronised one whose backward never reached DDP here.

    Posts this rank's notice in the step's namespace and waits (at most the DDP's
    timeout) until every rank posted one or a failure is posted; either way the caller
    goes on to :meth:`~.ddp_failure.StepWatch.begin_step`, which sees the failure (a
    fresh group, a warning) or none. Only a peer that died or froze, or the timeout,
    raises from there.
    """
    channel = watch.channel
    store = channel.store
    ticket = store.add(f"{channel.prefix}/skips", 1)
    store.set(_key(channel, ticket), str(channel.rank).encode())
    every = _key(channel, watch.world)
    if channel.rank == watch.lowest:
        watch.skipped_steps.append((watch.step, channel.prefix))
    try:
        wait_until(
            lambda: store.check([every]),
            channel,
            timeout=watch.timeout,
            what="the other ranks' backward pass of a step whose backward never reached DDP here",
        )
    except RankError as error:
        if error.failure.kind == "error":
            return  # posted in the step: begin_step sees it and recovers on every rank
        raise


def check_skipped(channel: FailureChannel) -> None:
    """While waiting on a collective of the step: raise if a rank skipped its backward.

    A notice in the step's namespace means that rank will send nothing for this step;
    the failure is posted with it as the origin, so every rank names it.
    """
    first = _key(channel, 1)
    if not channel.store.check([first]):
        return
    skipper = int(channel.store.get(first).decode())
    failure = channel.post(
        "backward", MESSAGE.format(waiter=channel.rank), kind="error", rank=skipper
    )
    raise error_for(failure, channel.rank)


def drop_old_skips(watch: StepWatch) -> None:
    """At the start of a step, on the lowest rank: delete the keys of the skip rounds every
    rank has left, those of two steps back or older (a round of step ``N`` runs at the
    forward pass that begins step ``N + 1``; that step's reduction, or its own skip round,
    needs every rank, so all of them are past the round when step ``N + 2`` begins).

    Not when the step just ended failed (the watch's channel is still that step's): it
    may have failed here before needing anyone (a gradient hook of the pass that the
    round left prepared raised "marked ready only once"), while a peer still waited in
    the round for the keys deleted then. That peer waited out the timeout, and from
    there the ranks' steps no longer paired. They go once a later step ended well.
    """
    if watch.channel.poll() is not None:
        return
    rounds = watch.skipped_steps
    while rounds and rounds[0][0] < watch.step:
        _, prefix = rounds.pop(0)
        store = watch.channel.store
        for key in [
            f"{prefix}/skips",
            *(f"{prefix}/skipped/{t}" for t in range(1, watch.world + 1)),
        ]:
            store.delete_key(key)
