"""Under ``join()``: a rank still training tells the joined ranks of each forward pass.

The first joinable's forward pass sends the "not joined" all-reduce that the joined
ranks' count meets (carrying the pass's announcement under xgrad's own ``Join``), enters
the round a pass left open, and checks ``throw_on_early_termination``; see :mod:`.join`
for the sequence on both sides. Kept apart from the context (:mod:`.join`), whose
collectives it pairs with.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from xgrad.torch_backend import join_rounds
from xgrad.torch_backend.join_announce import Announcing, Row, count
from xgrad.torch_backend.join_rounds import failed_round, notified

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["notify_join_context"]


def notify_join_context(ddp: DistributedDataParallel, row: Row | None = None) -> int | None:
    """Tell a joined rank's context that this one still trains; the ranks still training.

    Called at the start of every forward pass inside an enabled join context (by the
    first joinable only, as PyTorch does). Returns the number of ranks still training
    when the gradients are to be divided by it, else ``None``. Under xgrad's own ``Join``
    the count carries this pass's announcement, ``row`` (:func:`~.join_announce.carried`).
    """
    # A round left open (join_rounds): this forward pass's all-reduce is this rank's part
    # of it, else (the context gone) no backward pass enters it any more.
    pending, ddp._grad_hooks.join_round = ddp._grad_hooks.join_round, None
    config = ddp._join_config
    if not (config.enable and config.is_first_joinable):
        return None
    order = ddp._join_order
    if order is not None and row is not None:
        order.shadows_others = not row[1]  # (join_absent: the joined rank's hooks after it)
    # These two pair with the join context's own, on the join group (not the private one).
    ones = count(ddp, 1.0, row)
    work = join_rounds.sum_async(ddp.process_group, ones)
    if pending is not None:  # before the throw check: one that went back raised already
        ddp._watch.wait_work(work, "join: the backward pass's round", ones.is_cuda)
        if failed_round(ddp, pending, ones[0].item()):  # met a failed step's GO: sent again
            ones = count(ddp, 1.0, row)
            work = join_rounds.sum_async(ddp.process_group, ones)
            ddp._watch.wait_work(work, "join: counting the ranks still training", ones.is_cuda)
        training = notified(ddp, pending, ones[0].item())
    if config.throw_on_early_termination:  # after the round: the peers' next all-reduce
        zeros = torch.zeros(1, device=ddp.join_device)
        check = dist.all_reduce(zeros, group=ddp.process_group, async_op=True)
        check.wait(timedelta(seconds=ddp.timeout))
        if zeros.item():
            raise RuntimeError(
                "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            )
    if ones.numel() > 1:  # the announcement rode in the count: read after the module ran
        ddp._announcing = Announcing(ddp, work, ones, 1)
    if pending is not None:
        return None if ddp._divide_by_initial_world_size else training
    if ddp._divide_by_initial_world_size:
        return None
    work.wait(timedelta(seconds=ddp.timeout))
    return int(ones[0].item())
