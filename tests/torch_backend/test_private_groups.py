"""Private groups after a subgroup that not every rank is in, on three gloo ranks.

Every rank calls ``dist.new_group([0, 1])`` (as PyTorch requires); only ranks 0 and 1
register it. The DDP's private group and the pipeline's lanes used to be named from each
process's count of registered groups, so rank 2 waited under another name: the DDP's
construction ended in a store timeout and the pipeline's first step hung for ever.
"""

from __future__ import annotations

from typing import Any

import torch

from xgrad.torch_backend.spawn import spawn


def _after_a_subgroup(rank: int, world: int) -> tuple[list[float], float, str]:
    import torch.distributed as dist
    from torch import nn

    import xgrad.pipeline as xp
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    ddp = DistributedDataParallel(model, timeout=20)
    ddp(torch.full((2, 3), float(rank))).sum().backward()
    assert model.weight.grad is not None
    stage = nn.Linear(3, 3)
    runtime = PipelineRuntime(xp.one_f_one_b(world, 3), [stage], nn.functional.mse_loss, timeout=20)
    x, y = torch.ones(6, 3), torch.zeros(6, 3)
    loss = runtime.step(x if rank == 0 else None, y if rank == world - 1 else None)
    pair = dist.new_group([0, 1])
    refused = ""
    if rank == 2:  # not in it: said so, not "num_stages must be an int >= 1, got -1"
        try:
            PipelineRuntime(xp.gpipe(2, 2), [stage], nn.functional.mse_loss, group=pair)
        except ValueError as exc:
            refused = str(exc)
    return model.weight.grad[0].tolist(), 0.0 if loss is None else float(loss), refused


def test_the_ddp_and_the_pipeline_work_after_a_subgroup_rank_2_is_not_in() -> None:
    results = spawn(_after_a_subgroup, 3, timeout=90)
    # Two rows of x = rank each, averaged over the three ranks.
    assert results[0][0] == results[1][0] == results[2][0] == [2.0, 2.0, 2.0]
    assert results[2][1] > 0.0
    assert results[2][2].startswith("group: rank 2 is not a member of this process group")


def _on_a_subgroup_after_another(rank: int, world: int) -> tuple[list[float], float, str]:
    import torch.distributed as dist
    from torch import nn

    import xgrad.pipeline as xp
    from xgrad.failure import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    dist.new_group([0, 1])  # rank 1 registers it, rank 2 does not
    pair = dist.new_group([1, 2])
    if rank == 0:
        return [], 0.0, ""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    ddp = DistributedDataParallel(model, process_group=pair, timeout=20)
    failed = ""
    try:  # a failed step replaces the private group: made alike again
        x = torch.full((2, 3), float(rank))
        ddp(x if rank == 1 else x[:, :2]).sum().backward()
    except RankError as exc:
        failed = str(exc)
    model.zero_grad()
    ddp(torch.full((2, 3), float(rank))).sum().backward()
    assert model.weight.grad is not None
    runtime = PipelineRuntime(
        xp.one_f_one_b(2, 2), [nn.Linear(3, 3)], nn.functional.mse_loss, group=pair, timeout=20
    )
    x, y = torch.ones(4, 3), torch.zeros(4, 3)
    loss = runtime.step(x if rank == 1 else None, y if rank == 2 else None)
    return model.weight.grad[0].tolist(), 0.0 if loss is None else float(loss), failed


def test_the_ddp_and_the_pipeline_work_on_a_subgroup_its_ranks_came_to_unlike() -> None:
    """Ranks 1 and 2 registered different numbers of groups before their own: PyTorch's
    name for a private group of theirs differed, and the DDP's construction hung."""
    results = spawn(_on_a_subgroup_after_another, 3, timeout=90)
    # Two rows of x = rank each, averaged over ranks 1 and 2.
    assert results[1][0] == results[2][0] == [3.0, 3.0, 3.0]
    assert results[2][1] > 0.0
    assert "rank 2" in results[1][2] and "rank 2" in results[2][2]


def _second_ddp_on_another_subgroup(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 run a DDP on [0, 1]; ranks 1 and 2 then one on [1, 2], whose first
    step fails in rank 2's forward pass."""
    import os
    import time

    import torch.distributed as dist
    from torch import nn

    from xgrad.failure import RankError
    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    first, second = dist.new_group([0, 1]), dist.new_group([1, 2])
    out: dict[str, Any] = {}
    if rank in (0, 1):
        DistributedDataParallel(nn.Linear(3, 3), process_group=first, timeout=10)
    if rank in (1, 2):
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        ddp = DistributedDataParallel(model, process_group=second, timeout=10)
        start = time.monotonic()
        try:
            ddp(torch.ones(2, 3) if rank == 1 else torch.ones(2, 2)).sum().backward()
        except RankError as exc:
            out["error"] = (str(exc), time.monotonic() - start)
        model.zero_grad()
        ddp(torch.full((2, 3), float(rank))).sum().backward()
        out["grad"] = model.weight.grad[0].tolist()
    return out


def test_a_failure_reaches_a_ddps_peer_that_made_more_ddps_before() -> None:
    """Rank 1's DDP on [1, 2] was its second, rank 2's its first: their failure channels
    were named apart, so rank 1 waited out the heartbeat and blamed a live rank 2 as
    stopped, at every later step too."""
    results = spawn(_second_ddp_on_another_subgroup, 3, timeout=90)
    for rank in (1, 2):
        text, seconds = results[rank]["error"]
        assert text.startswith("rank 2 in forward:"), text
        assert seconds < 5.0, seconds
        assert results[rank]["grad"] == [3.0, 3.0, 3.0]
