"""Under ``join()``: what the sum of a round (:mod:`.join_rounds`) tells the rank that reads it.

A round's sum packs three counts in one number (:func:`_parts`): the ranks whose step
failed before their backward pass (``FAIL``, the square of ``GO``), those that began the
backward pass (``GO``, the world size plus one), those that began their next forward pass
(1). The rank still training that opened it reads it in its backward pass
(:class:`~.join_rounds.OpenRound`), in its next forward pass (:func:`notified`) or as it
leaves ``join()`` (:func:`counted`); a joined rank in its wait (:func:`wait_round`) or its
count (:func:`failed_count`, :func:`failed_round`). Kept apart from the rounds' opening
and entering (:mod:`.join_rounds`), which re-exports these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from xgrad.failure import error_for
from xgrad.torch_backend.join_announce import ADVICE, count, heard

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel
    from xgrad.torch_backend.join_rounds import OpenRound

__all__ = [
    "counted",
    "failed_count",
    "failed_round",
    "notified",
    "on_join_group",
    "posted",
    "wait_round",
]


def failed_count(ddp: DistributedDataParallel, total: float) -> bool:
    """Whether a joined rank's count met a :func:`stand_in`."""
    return total >= _fail(ddp)


def _go(ddp: DistributedDataParallel) -> float:
    return float(ddp._watch.world + 1)


def _fail(ddp: DistributedDataParallel) -> float:
    """A rank whose step failed before its backward pass began (:meth:`OpenRound.fail`)."""
    return _go(ddp) ** 2


def on_join_group(
    ddp: DistributedDataParallel, value: float, what: str, posted: bool = True
) -> torch.Tensor:
    """A count (``value``: :func:`~.join_announce.count`) all-reduced on the join context's
    group, waited on through the watch (``posted``: its ``wait_work``'s)."""
    t = count(ddp, value)
    work = dist.all_reduce(t, group=ddp.process_group, async_op=True)
    ddp._watch.wait_work(work, what, t.is_cuda, posted=posted)
    return t


def _parts(ddp: DistributedDataParallel, total: int) -> tuple[int, int, int]:
    """(ranks whose step failed before their backward pass, ranks that began the backward
    pass, ranks that began their next forward pass)."""
    go = int(_go(ddp))
    failed, rest = divmod(total, go * go)
    went, forward = divmod(rest, go)
    return failed, went, forward


def posted(ddp: DistributedDataParallel) -> RuntimeError:
    """The step's failure (posted before a rank entered its round with ``FAIL``), naming
    the others."""
    watch = ddp._watch
    failure = watch.channel.poll()
    if failure is None:  # never: posted first
        return RuntimeError("join: a round said that a step failed and none was posted")
    return watch.naming_others(error_for(failure, watch.channel.rank))


def failed_round(ddp: DistributedDataParallel, pending: OpenRound, total: float) -> bool:
    """Whether this rank's part of the round (giving ``total``) met the ``GO`` of peers that
    began the backward pass of a step that failed (or a later step failed before this
    rank entered the round): no disagreement, the step is dropped everywhere, but those
    peers' next all-reduce on the join group is still to come, so this rank's part is sent
    again to meet it (else every later count pairs one rank's pass with another's next)."""
    failed, went, _ = _parts(ddp, round(total))
    return bool(failed or went) and ddp._watch.failed_at >= pending.step


def notified(ddp: DistributedDataParallel, pending: OpenRound, total: float) -> int:
    """This rank's next forward pass entered the round (its "not joined" all-reduce gave
    ``total``): the number of ranks still training, or the error when some went back."""
    _, went, forward = _parts(ddp, round(total))
    if went:
        rank = ddp._watch.channel.rank
        raise RuntimeError(
            f"rank {rank} ran a forward pass with gradients on and no backward pass after "
            f"it (its next forward pass came) while {went} of the {pending.training} ranks "
            f"still training ran that step's backward pass ({ADVICE})"
        )
    return forward


def counted(ddp: DistributedDataParallel, total: float) -> bool:
    """This rank left ``join()`` with a round open and its count gave ``total``: the error
    when some rank went back (``join()``'s own context, which sees the count); ``True``
    when the round was a failed step's (:func:`failed_round`): count again."""
    pending = ddp._grad_hooks.join_round
    if pending is None:
        return False
    if failed_round(ddp, pending, total):
        ddp._grad_hooks.join_round = None
        return True
    _, went, _ = _parts(ddp, round(total))
    if went:
        ddp._grad_hooks.join_round = None
        rank = ddp._watch.channel.rank
        raise RuntimeError(
            f"rank {rank} left join() after a forward pass with gradients on and no "
            f"backward pass while {went} of the {pending.training} ranks still training "
            f"ran that step's backward pass ({ADVICE})"
        )
    return False


def wait_round(ddp: DistributedDataParallel, training: int) -> str:
    """A joined rank, after a forward pass that a reducing backward pass may follow:
    ``"backward"`` (every rank still training began it), ``"forward"`` (none did; some
    began their next forward pass), ``"left"`` (every one left ``join()``), ``"failed"``
    (the step failed before some rank's backward pass: :meth:`OpenRound.fail`). A
    failure posted meanwhile does not end the wait: only the sum says which came."""
    t = on_join_group(ddp, 0.0, "join: the backward pass's round", posted=False)
    failed, went, forward = _parts(ddp, round(t[0].item()))
    if failed:
        return "failed"
    if went == training:
        return "backward"
    if not went:
        heard(ddp, t)  # their next forward pass's count: the announcement it carried
        return "forward" if forward else "left"
    message = (
        f"{went} of the {training} ranks still training began the backward pass of a step "
        f"that the other {training - went} left without one (a forward pass with "
        f"gradients on and no backward pass after it, on some ranks only; {ADVICE})"
    )
    raise ddp._watch.post("join", RuntimeError(message))
