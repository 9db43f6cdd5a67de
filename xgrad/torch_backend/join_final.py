"""The end of ``join()``: every rank takes the parameters and buffers of a rank that joined last.

PyTorch's ``_find_common_rank`` and ``_sync_final_model``, on the DDP's private group,
watched and bounded like its reductions. Kept apart from the joined rank's shadow of the
others' steps (:mod:`.join_hook`), whose post hook runs it; the DDP's buffer sync under
``join()`` uses :func:`find_common_rank` too (:mod:`.ddp_buffers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["find_common_rank", "sync_final_model"]


def _allreduce(ddp: DistributedDataParallel, value: float, op: Any = None) -> torch.Tensor:
    """A one-element allreduce on the DDP's private group, watched like its reductions
    and waited on with its timeout."""
    t = torch.tensor([value], device=ddp.join_device)
    work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=ddp.comm.group, async_op=True)
    ddp._watch.wait_work(work, "join allreduce", t.is_cuda)
    return t


def find_common_rank(ddp: DistributedDataParallel, rank: int, candidate: bool) -> int:
    """The largest rank among the candidates (PyTorch's ``_find_common_rank``)."""
    found = int(_allreduce(ddp, rank if candidate else -1, dist.ReduceOp.MAX).item())
    if found < 0:
        raise RuntimeError(
            f"join: no rank offered itself as the authoritative copy (seen on rank {rank})"
        )
    return found


def sync_final_model(ddp: DistributedDataParallel, is_last_joiner: bool) -> None:
    """Broadcast the parameters and buffers of the largest rank that joined last."""
    from xgrad.torch_backend.sync import broadcast_state

    src = find_common_rank(ddp, ddp.comm.rank, is_last_joiner)
    broadcast_state(
        ddp.comm,
        ddp.module,
        buffers=ddp.forward_sync_buffers,
        ignore=ddp.parameters_to_ignore,
        src=src,
    )
