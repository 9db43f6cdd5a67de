"""Two replicas of a two-stage pipeline: a failure in one is named alike in the other.

Four gloo ranks: pipelines {0, 1} and {2, 3}, averaged over ``dp_group`` {0, 2} and
{1, 3} at REDUCE_GRAD. Rank 1 raises (or is killed) in its ``1B2`` of step 1. The other
replica learns it through the data-parallel all-reduce, and used to raise it as its own
live rank's failure with the origin nested in the text (``rank 3: 1REDUCE_GRAD failed:
RankError: rank 1 ...``), a dead rank as a plain ``RankError`` (not a
``RankUnresponsiveError``); relayed as it is, every rank now names rank 1 with its kind
(the other replica also where it reached that pipeline), and after a raise the next steps
work. The same with each stage a DDP over its replicas instead of ``dp_group`` (a guard:
the sweep of session 36 found these right; it found the DDP stages' default ``no_sync``
missing, test_torch_pipeline_ddp_default).
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn

import xgrad.pipeline as xp


def _replicas(rank: int, world: int, how: str, mode: str = "dp_group") -> list[Any]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    torch.manual_seed(stage)  # the replicas of a stage start alike
    part = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    schedule = xp.add_stage_ops(xp.one_f_one_b(2, 4))
    if mode == "ddp":  # a DDP stage, its own no_sync (the runtime's default)
        ddp = DistributedDataParallel(part, process_group=dps[stage], timeout=10)
        rt = PipelineRuntime(
            schedule, [ddp], nn.functional.mse_loss, group=pipes[replica], timeout=10
        )
    else:
        rt = PipelineRuntime(
            schedule, [part], nn.functional.mse_loss, group=pipes[replica], timeout=10,
            dp_group=dps[stage],
        )  # fmt: skip
    original = type(rt)._perform
    armed = [False]

    def perform(self: Any, action: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and str(action) == "1B2":
            armed[0] = False
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("boom")
        return original(self, action, *args, **kwargs)

    type(rt)._perform = perform  # type: ignore[method-assign]
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out: list[Any] = []
    for step in range(3 if how == "raise" else 2):
        part.zero_grad(set_to_none=True)
        armed[0] = rank == 1 and step == 1
        try:
            rt.step(x if stage == 0 else None, x if stage == 1 else None)
            out.append([p.grad.tolist() for p in part.parameters()])
        except Exception as exc:
            out.append((type(exc).__name__, exc.failure.rank, exc.failure.kind, str(exc)))
    return out


def test_a_raise_in_one_replica_is_named_alike_in_the_other_and_the_next_step_works() -> None:
    results, codes = run_ranks(_replicas, 4, ("raise",), timeout=120)
    assert set(codes.values()) == {0}, (codes, results)
    for rank in range(4):
        status, out = results[rank]
        assert status == "ok", out
        kind, origin, failure_kind, text = out[1]
        assert kind.startswith("RankError"), out[1]  # RankError[ValueError] on rank 1
        assert (origin, failure_kind) == (1, "error"), out[1]
        own = "rank 1: 1B2 failed: ValueError: boom"
        if rank < 2:
            assert text == own, text
        else:  # through rank 2's all-reduce (rank 0 told it) or rank 3's (rank 1 did)
            by = r"\(raised in the pipeline by (rank 2, in 0|rank 3, in 1)REDUCE_GRAD\)"
            assert re.fullmatch(f"{own}\n{by}", text), text
        assert out[2] == out[0], "the step after the failure differs from the one before"


def test_a_rank_killed_in_one_replica_is_unresponsive_in_the_other_too() -> None:
    results, codes = run_ranks(_replicas, 4, ("kill",), timeout=120)
    assert codes[1] == -signal.SIGKILL, codes
    for rank in (0, 2, 3):
        status, out = results[rank]
        assert status == "ok", out
        kind, origin, failure_kind, text = out[1]
        assert kind == "RankUnresponsiveError", out[1]
        assert (origin, failure_kind) == (1, "unresponsive"), out[1]
        assert text.startswith("rank 1: stopped answering"), text


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failure_in_one_replica_of_ddp_stages_reaches_the_other(how: str) -> None:
    """The same with each stage a DDP over its replicas (no ``no_sync`` given): the other
    replica learns of the failure in its DDP's reduction, names rank 1 with its kind,
    and after a raise the next step is the same as the one before."""
    results, codes = run_ranks(_replicas, 4, (how, "ddp"), timeout=120)
    alive = (0, 1, 2, 3) if how == "raise" else (0, 2, 3)
    if how == "kill":
        assert codes[1] == -signal.SIGKILL, codes
    for rank in alive:
        status, out = results[rank]
        assert status == "ok", out
        kind, origin, failure_kind, text = out[1]
        if how == "kill":
            assert kind == "RankUnresponsiveError", out[1]
            assert (origin, failure_kind) == (1, "unresponsive"), out[1]
            assert text.startswith("rank 1: stopped answering"), text
        else:
            assert kind.startswith("RankError"), out[1]
            assert (origin, failure_kind) == (1, "error"), out[1]
            assert text.startswith("rank 1: 1B2 failed: ValueError: boom"), text
            assert out[2] == out[0], "the step after the failure differs from the one before"
