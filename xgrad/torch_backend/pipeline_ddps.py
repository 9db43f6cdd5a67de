"""The DDPs inside a pipeline's partitions, told when a pipeline step fails.

A stage wrapped in xgrad's DDP reduces its gradients with the same stage of the other
data-parallel replicas (``no_sync`` for all microbatches but the last). When one replica's
pipeline step fails, its DDPs never reach that step's reduction; without a word the other
replicas' reductions paired with this replica's *next* step's (silently wrong gradients,
then a gloo size mismatch that aborts the process). So the runtime tells each DDP of its
partitions that the step was given up (``DistributedDataParallel._abandon_step``), and
the DDP posts that where its peers wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from xgrad.failure import RankError

__all__ = ["ddp_steps", "stage_ddps", "tell_ddps"]


def stage_ddps(partitions: Sequence[nn.Module]) -> list[Any]:
    """The xgrad DDPs among ``partitions`` and their submodules."""
    return [
        m for p in partitions for m in p.modules() if callable(getattr(m, "_abandon_step", None))
    ]


def ddp_steps(ddps: Sequence[Any]) -> list[int]:
    """Each DDP's step number, at the start of a pipeline step."""
    return [ddp._watch.step for ddp in ddps]


def tell_ddps(ddps: Sequence[Any], error: RankError, since: Sequence[int]) -> None:
    """After a failed step (``error``): each DDP whose step this rank gave up (it was
    accumulating for one, its synchronised pass was cut short, or it had not begun the
    one its peers are in: its number is still ``since``'s) tells its peers at once."""
    for ddp, step in zip(ddps, since, strict=True):
        with contextlib.suppress(Exception):  # the step's own error is the one raised
            ddp._abandon_step("pipeline step", error, since=step)
