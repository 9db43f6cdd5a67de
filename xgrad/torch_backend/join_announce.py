"""Under ``join()``: what a forward pass tells the joined ranks (the announcement).

Each forward pass, every rank gathers what every other does (a joined rank's row is
empty): whether gradients are on (a rebuild of the buckets comes only then), whether a
backward pass that reduces may follow, whether buffers sync at the next one. The ranks
still training must agree, or every rank raises at once, naming what each ran
(:func:`disagreement`). Sent before the module runs and read after it, so that no one
waits for it where it is sent; what the announcement calls for (a round) is
:mod:`.join_rounds`'.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["ADVICE", "Announced", "Announcing", "announce", "disagreement", "hear", "sum_async"]

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


def sum_async(group: Any, t: torch.Tensor) -> Any:
    """An all-reduce (sum) of ``t`` on ``group``, not waited for: the group's own call, as
    the reducer launches its buckets (``dist.all_reduce``'s checks cost as much again,
    and there are three of these per step under ``join()``)."""
    return group.allreduce([t], _SUM)


class Announcing:
    """An announcement under way on the DDP's group: every rank's row (none for a joined
    rank), summed where each writes only its own; :meth:`read` waits for it."""

    def __init__(self, ddp: DistributedDataParallel, row: tuple[bool, bool, bool] | None) -> None:
        self.ddp = ddp
        self.table = torch.zeros(ddp._watch.world, 4, device=ddp.join_device)
        if row is not None:
            self.table[ddp.comm.rank] = torch.tensor([1.0, *map(float, row)])
        self.work = sum_async(ddp.comm.group, self.table)

    def read(self) -> Announced:
        """What the ranks still training said: alike, or every rank raises, naming them."""
        watch = self.ddp._watch
        watch.wait_work(self.work, "join announcement", self.table.is_cuda)
        rows = {
            i: (bool(r[1]), bool(r[2]), bool(r[3]))
            for i, r in enumerate(self.table.tolist())
            if r[0]
        }
        if len(set(rows.values())) > 1:
            raise RuntimeError(disagreement(watch.ranks, rows))
        grad, reduce, param_sync = next(iter(rows.values()), (False, False, False))
        return Announced(len(rows), grad, reduce, param_sync)


def announce(ddp: DistributedDataParallel, grad: bool, reduce: bool, param_sync: bool) -> None:
    """A rank still training, before its forward pass: its flags, sent, to be read by
    :func:`~.join_rounds.read_announcement` after the module ran (or before a rebuild)."""
    ddp._announcing = Announcing(ddp, (grad, reduce, param_sync))


def hear(ddp: DistributedDataParallel) -> Announced:
    """A joined rank: what the ranks still training announced."""
    return Announcing(ddp, None).read()
