"""``ddp.join()`` around a pipeline of DDP stages whose replicas run different numbers of steps.

Four gloo ranks: pipelines {0, 1} and {2, 3}, each stage a DDP over its replicas ({0, 2}
and {1, 3}); replica 0 has two batches, replica 1 four, each rank's loop under its DDP's
``join()``. Replica 1's last two steps are taken with replica 0 joined: each stage's
gradient is then replica 1's own divided by the initial world size (PyTorch's join
default). With a step of replica 1 failing after replica 0 joined (rank 3's backward
raising, caught per step): the step's failure reaches every rank, the joined replica
raises it as ``join()`` ends, and replica 1's next step is right. Before, the pipeline
gave the step up in the middle of the DDP's accumulation with no count standing in for
its synchronised pass: the joined rank waited in its count for one, the training rank's
next pass waited for the joined rank's mark, each to the DDP's timeout, and replica 1's
next steps failed too ("timed out ... (a rank still training neither began the step
after the failed one nor left join() raising it)", then "rank 0: stopped answering").
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
from ranks import every_rank_ok
from torch import nn

TIMEOUT = 5.0
STEPS = (2, 4)  # replica 0's batches, replica 1's


def _batches(replica: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(10 + replica)
    return [
        (torch.randn(6, 4, generator=g, dtype=torch.float64),
         torch.randn(6, 4, generator=g, dtype=torch.float64))
        for _ in range(STEPS[replica])
    ]  # fmt: skip


def _blocks() -> list[nn.Module]:
    import torch

    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(2)]


def _wanted(place: int) -> list[Any]:
    """Per step, stage ``place``'s gradient: the mean over the replicas that still train,
    divided by the initial world size (2) where one has joined."""
    blocks, data = _blocks(), [_batches(0), _batches(1)]
    wants = []
    for step in range(STEPS[1]):
        for block in blocks:
            block.zero_grad(set_to_none=True)
        for batches in data:
            if step < len(batches):
                x, y = batches[step]
                nn.functional.mse_loss(blocks[1](blocks[0](x)), y).backward()
        wants.append([p.grad.clone() / 2 for p in blocks[place].parameters()])
    return wants


def _run(rank: int, world: int, fail_at: int) -> dict[str, Any]:
    import torch.distributed as dist

    import xgrad.pipeline as xp
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, place = divmod(rank, 2)
    part = _blocks()[place]
    ddp = DistributedDataParallel(part, process_group=dps[place], timeout=TIMEOUT)
    rt = PipelineRuntime(xp.make("1f1b", 2, 3), [ddp], nn.functional.mse_loss, group=pipes[replica])
    wants = _wanted(place)

    def boom(grad: Any) -> Any:
        raise ValueError("boom")

    steps: list[Any] = []
    started = time.monotonic()
    try:
        with ddp.join():
            for step, (x, y) in enumerate(_batches(replica)):
                part.zero_grad(set_to_none=True)
                armed = rank == 3 and step == fail_at
                hook = part[0].weight.register_hook(boom) if armed else None
                try:
                    rt.step(x if place == 0 else None, y if place == 1 else None)
                    steps.append(
                        max(
                            float((p.grad - w).abs().max())
                            for p, w in zip(part.parameters(), wants[step], strict=True)
                        )
                    )
                except Exception as exc:
                    steps.append(f"{type(exc).__name__}: {exc}")
                finally:
                    if hook is not None:
                        hook.remove()
        ended = ""
    except Exception as exc:
        ended = f"{type(exc).__name__}: {exc}"
    return {"steps": steps, "ended": ended, "took": time.monotonic() - started}


@pytest.mark.parametrize("fail_at", [-1, 2])
def test_replicas_of_different_lengths_under_join(fail_at: int) -> None:
    results = every_rank_ok(functools.partial(_run, fail_at=fail_at), 4, timeout=120)
    failure = "RankError: rank 3: 1B0 failed: ValueError: boom"
    for rank, found in results.items():
        assert found["took"] < TIMEOUT, (rank, found)  # no wait to the timeout
        steps = found["steps"]
        if rank < 2:  # replica 0: its two steps, then joined
            assert all(e <= 1e-12 for e in steps), (rank, found)
            assert found["ended"] == ("" if fail_at < 0 else failure), (rank, found)
            continue
        assert found["ended"] == "", (rank, found)
        failed = [i for i, e in enumerate(steps) if isinstance(e, str)]
        assert failed == ([] if fail_at < 0 else [fail_at]), (rank, found)
        if fail_at >= 0:
            assert steps[fail_at].startswith(
                "RankError[ValueError]: " if rank == 3 else "RankError: "
            ), steps[fail_at]
            assert failure.split(": ", 1)[1] in steps[fail_at], steps[fail_at]
        assert all(e <= 1e-12 for i, e in enumerate(steps) if i not in failed), (rank, found)
