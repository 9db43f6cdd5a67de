"""Private groups after a subgroup that not every rank is in, on three gloo ranks.

Every rank calls ``dist.new_group([0, 1])`` (as PyTorch requires); only ranks 0 and 1
register it. The DDP's private group and the pipeline's lanes used to be named from each
process's count of registered groups, so rank 2 waited under another name: the DDP's
construction ended in a store timeout and the pipeline's first step hung for ever.
"""

from __future__ import annotations

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
