"""Under ``join()``: what a forward pass tells the joined ranks (the announcement).

Each forward pass, every rank gathers what every other does (a joined rank's row is
empty): whether gradients are on (a rebuild of the buckets comes only then), whether a
backward pass that reduces may follow, whether buffers sync at the next one. The ranks
still training must agree, or every rank raises at once, naming what each ran
(:func:`disagreement`). Sent before the module runs and read after it, so that no one
waits for it where it is sent; what the announcement calls for (a round) is
:mod:`.join_rounds`'.

Under xgrad's own :class:`~.join.Join` the first joinable's announcement rides in the
join context's count (:func:`carried`): the "not joined" all-reduce of its forward pass
carries, after the count, every rank's row, 4 bits a rank (this rank's; a joined
rank's count, a round's ``GO`` and a leaving rank's count none), so that a step sends
two collectives of ``join()``'s, as PyTorch's DDP does, not three, and the count stays
two elements up to 15 ranks (gloo all-reduces one or two elements in about two thirds
of the time it takes for three or more). Every all-reduce that
may meet the count on the join group is sized alike (:func:`count`): the count, a
joined rank's, the round's parts; the ``throw_on_early_termination`` check alone stays
one element, met only by the joined ranks' one-element notice. A joined rank keeps what
its count (or a round that the ranks still training entered with their next forward
pass) carried, for its hook to read (:func:`heard`, :func:`hear`). PyTorch's ``Join``
counts in one element, blind to the table: there the announcement is an all-reduce of
its own on the DDP's group, as is every other DDP's in the same context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = [
    "ADVICE",
    "Announced",
    "Announcing",
    "announce",
    "carried",
    "count",
    "disagreement",
    "hear",
    "heard",
    "sum_async",
]

#: what a rank still training announces: gradients on, a reducing backward pass may
#: follow, buffers sync at the next forward pass.
Row = tuple[bool, bool, bool]

#: bits of a rank's row in the table: present (a rank still training), then its flags.
_BITS = 4
#: ranks per element of the table (int64): 60 of its 63 bits, so that the sum of rows,
#: each rank setting only its own bits, is every rank's row, exact.
_PER = 15

#: a sum, for the group's own ``allreduce``.
_SUM = dist.AllreduceOptions()

#: the advice every error of a round gives.
ADVICE = (
    "inside join() the ranks still training must run the same passes, the joined ranks "
    "shadowing them: run an evaluation under torch.no_grad(), or on some ranks only "
    "through ddp.module"
)


@dataclass(frozen=True)
class Announced:
    """What the ranks still training said about their forward pass (all alike)."""

    training: int  #: how many ranks are still training
    grad: bool  #: gradients on: the buckets may be rebuilt
    reduce: bool  #: a backward pass that reduces may follow
    param_sync: bool  #: buffers sync at the next forward pass


def _mode(row: tuple[bool, bool, bool]) -> str:
    grad, reduce, param_sync = row
    if not grad:
        return "under torch.no_grad()"
    if param_sync:
        return "with gradients on"
    return "with gradients on under no_sync()" + (", to be reduced" if reduce else "")


def disagreement(ranks: list[int], rows: dict[int, tuple[bool, bool, bool]]) -> str:
    """The error when the ranks still training ran different kinds of forward passes."""
    by_mode = itertools.groupby(
        sorted(rows, key=lambda i: (_mode(rows[i]), i)), key=lambda i: _mode(rows[i])
    )
    parts = []
    for mode, group in by_mode:
        names = [ranks[i] for i in group]
        parts.append(f"rank{'s' if len(names) > 1 else ''} {', '.join(map(str, names))} {mode}")
    return (
        "join(): the ranks still training ran different forward passes: "
        + "; ".join(parts)
        + f" ({ADVICE})"
    )


def _after_failure(failed_at: int) -> str:
    """What the disagreement error adds once a step of the DDP failed: a rank that went on
    with that step's remaining ``no_sync`` micro-batches pairs its passes with its peers'
    next ones, from then on (outside ``join()`` the DDP places them, :mod:`.ddp_which_step`;
    here the ranks count each pass, and the failing one stood in for the step's
    synchronised pass at its next)."""
    if failed_at <= 0:
        return ""
    return (
        "; a step of this DDP failed before: a rank that went on with a failed step's "
        "remaining micro-batches (a try per micro-batch) runs its passes out of step with its "
        "peers' under join(): end the accumulation on an error (a try per step)"
    )


def sum_async(group: Any, t: torch.Tensor) -> Any:
    """An all-reduce (sum) of ``t`` on ``group``, not waited for: the group's own call, as
    the reducer launches its buckets (``dist.all_reduce``'s checks cost as much again,
    and there are two or three of these per step under ``join()``)."""
    return group.allreduce([t], _SUM)


def carried(joinable: Any) -> bool:
    """Whether this DDP's announcement rides in the join context's count: it is the first
    joinable (whose forward pass sends the count) of xgrad's own ``Join``
    (:func:`~.join_rounds.counting`), whose count is sized alike (:func:`count`).
    PyTorch's ``Join`` counts in one element: there the announcement goes on its own."""
    config = joinable._join_config
    return config.is_first_joinable and getattr(joinable, "_counted_config", None) is config


def _slots(world: int) -> int:
    return -(-world // _PER)


def _table(ddp: DistributedDataParallel, head: list[int], row: Row | None) -> torch.Tensor:
    """``head``, then every rank's row, packed (int64, :data:`_PER` ranks an element):
    this rank's ``row`` (flagged present) in its own bits, the others' zeros, so that the
    sum over the ranks is every rank's row. Packed because gloo's all-reduce of more than
    two elements costs about half as much again as one of one or two."""
    values = head + [0] * _slots(ddp._watch.world)
    if row is not None:
        rank = ddp.comm.rank
        code = 1 | sum(int(flag) << (k + 1) for k, flag in enumerate(row))
        values[len(head) + rank // _PER] = code << (_BITS * (rank % _PER))
    return torch.tensor(values, dtype=torch.int64, device=ddp.join_device)


def count(ddp: DistributedDataParallel, value: float, row: Row | None = None) -> torch.Tensor:
    """What this rank sends on the join context's group (its count, a round's part):
    ``value``, and, where the announcement rides in it (:func:`carried`), the table, with
    ``row`` (a rank still training's forward pass) or not (a joined rank, a ``GO``): two
    elements up to 15 ranks, as cheap to all-reduce as PyTorch's one."""
    if not carried(ddp):
        return torch.tensor([value], device=ddp.join_device)
    return _table(ddp, [int(value)], row)


class Announcing:
    """An announcement under way: every rank's row (none for a joined rank), summed where
    each writes only its own, in ``values`` from ``start`` on (on the DDP's group; or
    after the count on the join context's, :func:`carried`); :meth:`read` waits for it
    (``work``: ``None`` when waited for already)."""

    def __init__(
        self, ddp: DistributedDataParallel, work: Any, values: torch.Tensor, start: int = 0
    ) -> None:
        self.ddp = ddp
        self.work = work
        self.values = values
        self.start = start

    def read(self) -> Announced:
        """What the ranks still training said: alike, or every rank raises, naming them."""
        watch = self.ddp._watch
        if self.work is not None:
            watch.wait_work(self.work, "join announcement", self.values.is_cuda)
        flat = self.values.tolist()
        rows = {}
        for i in range(watch.world):
            code = flat[self.start + i // _PER] >> (_BITS * (i % _PER))
            if code & 1:
                rows[i] = (bool(code & 2), bool(code & 4), bool(code & 8))
        if len(set(rows.values())) > 1:
            raise RuntimeError(disagreement(watch.ranks, rows) + _after_failure(watch.failed_at))
        grad, reduce, param_sync = next(iter(rows.values()), (False, False, False))
        return Announced(len(rows), grad, reduce, param_sync)


def announce(ddp: DistributedDataParallel, grad: bool, reduce: bool, param_sync: bool) -> None:
    """A rank still training, before its forward pass: its flags, sent on the DDP's group
    (unless :func:`carried` in its count), to be read by
    :func:`~.join_rounds.read_announcement` after the module ran (or before a rebuild)."""
    table = _table(ddp, [], (grad, reduce, param_sync))
    ddp._announcing = Announcing(ddp, sum_async(ddp.comm.group, table), table)


def heard(ddp: DistributedDataParallel, total: torch.Tensor) -> None:
    """A joined rank: the count it took part in (its own, or a round that the ranks still
    training entered with their next forward pass), kept for :func:`hear` when the
    announcement rode in it."""
    if total.numel() > 1:
        ddp._heard = Announcing(ddp, None, total, 1)


def hear(ddp: DistributedDataParallel) -> Announced:
    """A joined rank: what the ranks still training announced (in the count it took part
    in last, when :func:`carried`)."""
    if carried(ddp):
        pending, ddp._heard = ddp._heard, None
        if pending is None:
            raise RuntimeError(
                "join: no count carried the announcement of the ranks still training"
            )
        return pending.read()
    table = _table(ddp, [], None)
    return Announcing(ddp, sum_async(ddp.comm.group, table), table).read()
