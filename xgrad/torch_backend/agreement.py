"""Ranks agree before a step: one small all-gather of digests, on a torch process group.

Used by the pipeline runtime (the schedule) and open to any other user that must check
that every rank runs the same plan before a collective that would otherwise hang or mix
data. The comparison and its message are the core's (:mod:`xgrad.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from xgrad.agreement import Fingerprint, disagreement_error
from xgrad.failure import FailureChannel
from xgrad.torch_backend.failure import wait_work

__all__ = ["check_agreement"]


def _as_int(digest: str) -> int:
    return int.from_bytes(bytes.fromhex(digest)[:8], "little", signed=True)


def check_agreement(
    what: str,
    digest: str,
    text: Callable[[], str],
    *,
    where: str,
    group: Any = None,
    timeout: float | None = None,
    channel: FailureChannel | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Raise the same ``DisagreementError`` on every rank of ``group`` unless all ``digest`` agree.

    Costs one all-gather of one int64 per rank (bounded by ``timeout``); only when the
    digests differ does each rank also gather ``text()`` to name the first difference.

    Args:
        what: what is compared, for the message ("pipeline schedule").
        where: who checks, for the message ("PipelineRuntime").
        digest: this rank's hex digest (e.g. ``Schedule.digest()``).
        text: this rank's description, called only on disagreement.
        group: the process group (default: the default group).
        timeout: seconds the all-gather may take.
        channel: a failure channel to watch while waiting.
        device: where the digest tensor lives (a CUDA device for NCCL).
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([_as_int(digest)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait_work(work, channel, timeout=timeout, what=f"{what} agreement (all-gather)")
    values = [int(t.item()) for t in gathered]
    if len(set(values)) == 1:
        return
    texts: list[Any] = [None] * world
    dist.all_gather_object(texts, text(), group=group)
    prints = [Fingerprint.of(what, line=str(t).splitlines()) for t in texts]
    raise disagreement_error(prints, where=where, rank=dist.get_rank(group))
