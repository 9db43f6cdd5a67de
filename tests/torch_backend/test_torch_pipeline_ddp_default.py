"""A DDP stage without ``no_sync``: the runtime uses the DDP's own, as torch's stage does.

Four gloo ranks: pipelines {0, 1} and {2, 3}, each stage a DDP over its replicas ({0, 2}
and {1, 3}), each replica on its own batch, no ``no_sync`` given. Each microbatch's
forward pass was then a synchronised one: the DDP reduced the first backward pass to
come and kept the later ones' gradients unreduced, so a stage whose forward passes run
ahead of its backward passes (GPipe's; 1F1B's first stage) got the same, silently wrong
gradients on both replicas (relative error 0.73 here), with xgrad's DDP or PyTorch's.
Now a partition holding a DDP runs its microbatches but the last under that DDP's
``no_sync`` (torch's ``PipelineStage`` does the same for a DDP stage), and a DDP stage
given ``dp_group`` too is refused (two reductions of one gradient).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

M = 3


def _stages(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(2)]
    gens = [torch.Generator().manual_seed(10 + r) for r in range(2)]
    data = [
        (torch.randn(6, 4, generator=g, dtype=torch.float64),
         torch.randn(6, 4, generator=g, dtype=torch.float64))
        for g in gens
    ]  # fmt: skip
    for x, y in data:
        nn.functional.mse_loss(blocks[1](blocks[0](x)), y).backward()
    want = [p.grad.clone() / 2 for p in blocks[stage].parameters()]
    part = blocks[stage]
    x, y = data[replica]
    found: dict[str, Any] = {}
    for kind in ("xgrad", "torch"):
        if kind == "xgrad":
            ddp: nn.Module = DistributedDataParallel(part, process_group=dps[stage], timeout=20)
        else:
            ddp = nn.parallel.DistributedDataParallel(part, process_group=dps[stage])
        for name in ("gpipe", "1f1b"):
            part.zero_grad(set_to_none=True)
            rt = PipelineRuntime(
                xp.make(name, 2, M), [ddp], nn.functional.mse_loss, group=pipes[replica]
            )
            rt.step(x if stage == 0 else None, y if stage == 1 else None)
            found[f"{kind} {name}"] = max(
                float((p.grad - w).norm() / w.norm())
                for p, w in zip(part.parameters(), want, strict=True)
            )
    try:
        PipelineRuntime(
            xp.add_stage_ops(xp.make("1f1b", 2, M)),
            [ddp],
            nn.functional.mse_loss,
            group=pipes[replica],
            dp_group=dps[stage],
        )
    except ValueError as exc:
        found["refused"] = str(exc)
    return found


def test_a_ddp_stage_reduces_once_per_step_without_no_sync() -> None:
    for rank, found in enumerate(spawn(_stages, 4, timeout=150)):
        assert found.pop("refused") == (
            f"rank {rank % 2}: partition 0 holds a DistributedDataParallel, which reduces "
            "its gradients itself: give dp_group with plain modules only"
        )
        assert set(found) == {"xgrad gpipe", "xgrad 1f1b", "torch gpipe", "torch 1f1b"}
        for case, error in found.items():
            assert error < 1e-12, (rank, case, error)
