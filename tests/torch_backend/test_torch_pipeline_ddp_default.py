"""A DDP stage without ``no_sync``: the runtime uses the DDP's own, as torch's stage does.

Four gloo ranks: pipelines {0, 1} and {2, 3}, each stage a DDP over its replicas ({0, 2}
and {1, 3}), each replica on its own batch, no ``no_sync`` given. Each microbatch's
forward pass was then a synchronised one: the DDP reduced the first backward pass to
come and kept the later ones' gradients unreduced, so a stage whose forward passes run
ahead of its backward passes (GPipe's; 1F1B's first stage) got the same, silently wrong
gradients on both replicas (relative errors 0.52 to 0.54 here, GPipe, 1F1B and
interleaved 1F1B), with xgrad's DDP or PyTorch's.
Now a partition holding a DDP runs its microbatches under that DDP's ``no_sync`` but
the one whose backward comes last (torch's ``PipelineStage`` does the same for a DDP
stage), and a DDP stage given ``dp_group`` too is refused (two reductions of one
gradient).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
import tanh_stages as ts  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

CASES = [
    ("xgrad", "gpipe"),
    ("xgrad", "1f1b"),
    ("xgrad", "interleaved_1f1b"),
    ("xgrad", "looped_bfs"),
    ("torch", "gpipe"),
    ("torch", "looped_bfs"),
]


def _stages(rank: int, world: int) -> dict[str, Any]:
    """Per case (DDP, schedule): the worst relative error of this rank's stages'
    gradients against the replicas' mean of the unpipelined model's; then two refusals."""
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, place = divmod(rank, 2)
    data = [ts.data(seed=10 + r) for r in range(2)]  # each replica's own batch
    found: dict[str, Any] = {}
    for kind, name in CASES:
        schedule = ts.schedule(name)
        blocks = ts.stages(schedule.num_stages)
        n = len(blocks)
        for x, y in data:
            h = x
            for block in blocks:
                h = block(h)
            nn.functional.mse_loss(h, y).backward()
        mine = list(schedule.stages_of(place))
        want = {s: [p.grad.clone() / 2 for p in blocks[s].parameters()] for s in mine}
        for block in blocks:
            block.zero_grad(set_to_none=True)
        if kind == "xgrad":
            ddps = [
                DistributedDataParallel(blocks[s], process_group=dps[place], timeout=20)
                for s in mine
            ]
        else:
            ddps = [
                nn.parallel.DistributedDataParallel(blocks[s], process_group=dps[place])
                for s in mine
            ]
        rt = PipelineRuntime(schedule, ddps, nn.functional.mse_loss, group=pipes[replica])
        x, y = data[replica]
        rt.step(x if 0 in mine else None, y if n - 1 in mine else None)
        found[f"{kind} {name}"] = max(
            float((p.grad - w).norm() / w.norm())
            for s in mine
            for p, w in zip(blocks[s].parameters(), want[s], strict=True)
        )
    ddp = DistributedDataParallel(nn.Linear(3, 3), process_group=dps[place], timeout=20)
    for why, schedule, kw in (
        ("dp_group", xp.add_stage_ops(ts.schedule("1f1b")), {"dp_group": dps[place]}),
        ("split", ts.schedule("zb_h1"), {}),
    ):
        try:
            PipelineRuntime(schedule, [ddp], nn.functional.mse_loss, group=pipes[replica], **kw)
        except ValueError as exc:
            found[why] = str(exc)
    return found


def test_a_ddp_stage_reduces_once_per_step_without_no_sync() -> None:
    """Each schedule with whole backward passes, looped BFS too (its stages' last backward
    is the first microbatch's: with ``no_sync`` given it was refused, "stage 0's last
    backward must be of microbatch 3"; without, it was right only because each
    microbatch's recomputed forward ran right before its backward, one reduction each),
    with xgrad's DDP or PyTorch's; a DDP stage with ``dp_group``, or with a schedule that
    splits its backward, refused by name."""
    for rank, found in enumerate(spawn(_stages, 4, timeout=170)):
        assert found.pop("dp_group") == (
            f"rank {rank % 2}: partition 0 holds a DistributedDataParallel, which reduces "
            "its gradients itself: give dp_group with plain modules only"
        )
        assert found.pop("split") == (
            f"rank {rank % 2}: data parallelism (no_sync) needs full backward passes; "
            "schedule 'zb_h1' splits them into I and W (reduce at REDUCE_GRAD instead: "
            "dp_group with plain modules)"
        )
        assert set(found) == {f"{kind} {name}" for kind, name in CASES}
        for case, error in found.items():
            assert error < 1e-12, (rank, case, error)
