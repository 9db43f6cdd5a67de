"""Under ``join()``: what a forward pass tells the joined ranks, and whether a backward followed.

A joined rank shadows the collectives of each forward pass of the ranks still training
(:mod:`.join`). PyTorch's DDP tells it "a backward pass follows" for every forward pass,
``torch.no_grad()`` ones included, and its joined ranks enter the bucket all-reduces at
once: an evaluation pass, or a forward pass with gradients on and no backward pass (a
validation loss), after a rank joined aborts every process in gloo ("Received data size
doesn't match expected size"). Here:

* Each forward pass, every rank gathers what every other does (the announcement,
  :mod:`.join_announce`); the ranks still training must agree, or every rank raises.
* After a forward pass that a reducing backward pass may follow, nobody can know yet
  whether one will, nor whether a rank leaves ``join()`` first. A *round* on the join
  context's group (where the ranks still training send their "not joined" all-reduce
  and a joined rank its count) settles it before a joined rank shadows any bucket: each
  joined rank enters it with 0, every rank still training with the first thing it does
  next: ``GO`` (the world size plus one) from the backward pass's first gradient hook, 1
  from its next forward pass (its "not joined" all-reduce), 0 from leaving ``join()``
  (the join context's count, PyTorch's ``Join`` included). The sum tells every rank alike: all went (the
  joined ranks shadow that backward pass), none did (they shadow the next forward pass,
  or every rank has left), or some did and some did not (each rank raises at once,
  naming what it did; the joined ranks and those that went post their error to the
  step's failure channel, so a rank waiting elsewhere stops too). Before any rank
  joined this is what names a rank that skipped a backward pass the others ran (the
  skip round of :mod:`.ddp_skipped` cannot: a rank may leave ``join()`` instead).
* A rank whose step failed before its backward pass began (its forward pass raised)
  enters the round with ``FAIL`` as it begins the next step (:meth:`OpenRound.fail`):
  the joined ranks, which wait past the failure, read in the sum that the step failed,
  keep its error for the end of ``join()`` and make the fresh group of the next step
  with the ranks still training (:mod:`.join_hook`).

Neither is waited for where it is sent, so that a step under ``join()`` waits no more
often than one outside it (PyTorch's DDP waits for neither of its own two per forward
pass): the announcement is sent before the module runs and read after it (or before
this rank's next collective on the DDP's group, a rebuild, if one comes first; or as
the module's exception is raised); the round, entered at the first gradient hook, is
read by the pass's first wait for a bucket (:func:`~.ddp_watched.run_deferred`).
Launching buckets before the round is read is safe under xgrad's own
:class:`~.join.Join` only: a joined rank reads the round before it shadows any bucket,
and a rank that leaves ``join()`` in the round reads it in its count and raises before
any collective on the DDP's group (:func:`counted`). Under PyTorch's ``Join``, blind to
the count, such a rank would shadow a forward pass against the buckets (gloo aborts),
and a communication hook may reduce on the join group itself: there the round is read
at the first hook, before any bucket. What a pass left unread (it raised first) is read
at the next forward pass or as the rank leaves ``join()`` (:func:`~.join_settle.settle`).

A rank that left ``join()`` in a round whose sum said everyone had left (its count gave
0) owes the joined ranks, which still count once more, that count (:func:`~.join_settle.close_round`).
Only the join context's first joinable has rounds (the one whose forward pass sends "not
joined"); another DDP in the same context shadows a backward pass after each forward
pass that may reduce, as before.

What a round's sum says, to whichever rank reads it, is :mod:`.join_sums`'s (re-exported
here).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from xgrad.failure import RankError
from xgrad.torch_backend.join_announce import (
    ADVICE,
    Announced,
    Announcing,
    announce,
    carried,
    count,
    disagreement,
    hear,
    sum_async,
)
from xgrad.torch_backend.join_sums import (
    _fail,
    _go,
    _parts,
    counted,
    failed_count,
    failed_round,
    notified,
    on_join_group,
    posted,
    wait_round,
)

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = [
    "Announced",
    "Announcing",
    "OpenRound",
    "announce",
    "counted",
    "counting",
    "disagreement",
    "failed_count",
    "failed_round",
    "hear",
    "notified",
    "on_join_group",
    "open_round",
    "posted",
    "read_announcement",
    "stand_in",
    "sum_async",
    "wait_round",
]


def read_announcement(ddp: DistributedDataParallel) -> None:
    """This rank's announcement under way, if any: read, and the round it calls for opened."""
    pending, ddp._announcing = ddp._announcing, None
    if pending is not None:
        try:
            announced = pending.read()
            order = ddp._join_order
            first = pending.start and order is not None and order.joinables[0] is ddp
            if first:
                order.training = announced.training  # (join_absent)
            if pending.start and pending.values[0].item() >= _fail(ddp):  # a peer's stand_in
                if first:
                    order.shadows_others = False  # the joined ranks count again (join_absent)
                raise posted(ddp)
        except RankError:
            _given_up(ddp)
            raise
        open_round(ddp, announced)


def _given_up(ddp: DistributedDataParallel) -> None:
    """The step's failure is raised here, in whatever pass of it this is (with
    accumulation passes varying per step, a ``no_sync`` one; read in the sum, a peer's
    stand-in, or posted while the sum waited): its accumulation ends, so that this rank's
    next pass begins the next step, with its fresh group, where the joined ranks wait for
    it, instead of reading the given-up step's failure again. So does that of the other
    DDPs of its xgrad ``Join`` whose step failed too (an iteration given up in another
    DDP's ``no_sync`` pass, :mod:`.join_given_up`)."""
    for peer in (ddp, *ddp._join_peers):
        hooks, watch = getattr(peer, "_grad_hooks", None), getattr(peer, "_watch", None)
        if hooks is None or watch is None or not hooks.accumulating:
            continue
        if peer is ddp or watch.channel.poll() is not None:
            hooks.accumulating = False


def stand_in(ddp: DistributedDataParallel, read: bool = False) -> bool:
    """A rank that gave up its step in a ``no_sync`` pass (posted) and skips the step's
    synchronised pass, which the other ranks still training run: under xgrad's ``Join``,
    ``FAIL`` in its place in the count, before the fresh group of the step after it.
    Their synchronised pass reads it in its count and raises the step's failure; a joined
    rank's count reads it, keeps the failure, begins the next step and counts again
    (:class:`~.join.Join`). Else their counts paired one step's pass with the next's.

    Returns whether this rank's synchronised pass next is the given-up step's (a loop
    with a ``try`` per micro-batch went on with it): not waited for unless ``read``, where
    a rank still training that met the count with a ``no_sync`` pass (more of the step's
    accumulation: the number of passes varies per step) says it is a later step's (the
    loop skipped the rest of the failed step, and the next step accumulates nothing),
    which this rank then trains instead of raising the given-up failure again. Where
    only joined ranks met it, nothing tells the two apart: the step's, as outside
    ``join()``."""
    if not (ddp._join_config.enable and carried(ddp)):
        return True
    t = count(ddp, _fail(ddp))
    work = sum_async(ddp.process_group, t)
    if not read:
        return True
    what = "join: the count standing in for a given-up step's synchronised pass"
    ddp._watch.wait_work(work, what, t.is_cuda, posted=False)
    met = Announcing(ddp, None, t, 1).read()  # the rows of the ranks still training
    return met.training == 0 or met.reduce


def _rounds(ddp: DistributedDataParallel, announced: Announced) -> bool:
    """Whether a round follows this forward pass (the first joinable's "not joined"
    all-reduce is what a rank's next forward pass enters it with)."""
    return announced.reduce and ddp._join_config.is_first_joinable


class OpenRound:
    """A rank still training whose forward pass opened a round: entered at the first
    gradient hook of its backward pass (``GO``), else by its next forward pass or its
    leaving ``join()``."""

    def __init__(self, ddp: DistributedDataParallel, training: int) -> None:
        self.ddp = ddp
        self.training = training
        self.step = ddp._watch.step  #: the DDP's step whose forward pass opened it

    def __call__(self) -> None:
        """The backward pass began here: enter the round with ``GO``; its sum is read
        now, or by the pass's first wait when that is safe (:func:`_late`)."""
        ddp = self.ddp
        t = count(ddp, _go(ddp))
        work = sum_async(ddp.process_group, t)
        read = functools.partial(self._read, work, t)
        if _late(ddp):
            ddp._watch.deferred = read
        else:
            read()

    def _read(self, work: Any, t: torch.Tensor) -> None:
        ddp = self.ddp
        ddp._watch.wait_work(work, "join: the backward pass's round", t.is_cuda)
        failed, went, _ = _parts(ddp, round(t[0].item()))
        if failed:  # a rank's forward pass (or what came before its backward) failed
            raise posted(ddp)
        if went != self.training:
            rank = ddp._watch.channel.rank
            message = (
                f"rank {rank} began the backward pass of a step that {self.training - went} "
                f"of the {self.training} ranks still training left without one (a forward "
                f"pass with gradients on and no backward pass after it, on some ranks only; "
                f"{ADVICE})"
            )
            raise ddp._watch.post("join", RuntimeError(message))

    def fail(self) -> None:
        """The step failed before this rank's backward pass began: its part is ``FAIL``,
        sent as it begins the next step, before that step's fresh group, which a joined
        rank makes once the round tells it (:func:`wait_round`). Not waited for: its next
        all-reduce on the group comes after it."""
        ddp = self.ddp
        sum_async(ddp.process_group, count(ddp, _fail(ddp)))


def _late(ddp: DistributedDataParallel) -> bool:
    """Whether the round may be read after buckets went out: under xgrad's own ``Join``
    (:func:`counting`; a rank that leaves in the round raises in its count) and with the
    reducer's own all-reduces, on the DDP's private group (a communication hook may
    reduce on the join group, or wait inside the hook)."""
    return ddp._counted_config is ddp._join_config and ddp.reducer.hook is None


def counting(joinables: Sequence[Any]) -> None:
    """xgrad's ``Join`` over these: its count is read by a rank that leaves in a round
    (:func:`counted`), so its DDPs may read their rounds late (:func:`_late`). Marked by
    the config the context set; another context (PyTorch's ``Join``) sets a new one."""
    for joinable in joinables:
        if hasattr(joinable, "_counted_config"):
            joinable._counted_config = joinable._join_config


def open_round(ddp: DistributedDataParallel, announced: Announced) -> None:
    """After the announcement of a rank still training: open a round if one follows."""
    if _rounds(ddp, announced):
        ddp._grad_hooks.join_round = OpenRound(ddp, announced.training)
