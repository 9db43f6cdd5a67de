"""A 2 × 2 layout (two pipeline replicas of two DDP stages) whose step fails in a stage's
synchronised pass, the last microbatch's: the next step works on every rank, its
gradients those of a run that never failed."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from failing import Raising  # noqa: E402
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

WIDTH, BATCH, M = 6, 16, 4
WHERE = ("forward", "backward", "late backward")
WORDS = {"forward": "bad batch", "backward": "bad gradient", "late backward": "bad gradient"}


class _Stage(nn.Module):
    """Two layers; in its synchronised pass (``synced()``), when told (``fail``), it raises
    in the forward, or in the backward before any gradient reached DDP ("backward", at the
    output) or after the outer layer's did ("late backward", between the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fail = ""
        self.synced: Any = lambda: False  # set once the DDP exists (no module attribute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = self.fail if torch.is_grad_enabled() and self.synced() else ""
        self.fail = "" if where else self.fail
        if where == "forward":
            raise ValueError("bad batch")
        h = torch.tanh(self.inner(x))
        if where == "late backward":
            Raising.armed = True
        h = Raising.apply(h)
        out = torch.tanh(self.outer(h))
        if where == "backward":
            Raising.armed = True
        return Raising.apply(out)


def _stages() -> list[_Stage]:
    torch.manual_seed(0)
    return [_Stage() for _ in range(2)]


def _reference(x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each stage's gradients from the whole batch, unpipelined (the replicas take the
    same batch, so their average is the same)."""
    stages = _stages()
    nn.functional.mse_loss(stages[1](stages[0](x)), y).backward()
    return [[p.grad.clone() for p in s.parameters() if p.grad is not None] for s in stages]


def _sync_pass_fails(rank: int, world: int) -> dict[str, list[Any]]:
    """Pipelines {0, 1} and {2, 3}, data-parallel groups {0, 2} and {1, 3}; per case
    (where, culprit), fresh stages, DDPs and runtimes for three steps, the culprit's stage
    failing in its synchronised pass at step 1. Per step: the error, or the worst
    gradient error against the unpipelined run."""
    import os

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    want = _reference(x, y)[pp_rank]
    results: dict[str, list[Any]] = {}
    for where in WHERE:
        for culprit in range(world):
            stage = _stages()[pp_rank]
            ddp = DistributedDataParallel(stage, process_group=dp_groups[pp_rank], timeout=20)
            stage.synced = lambda ddp=ddp: ddp.require_backward_grad_sync
            rt = PipelineRuntime(
                xp.one_f_one_b(2, M),
                [ddp],
                nn.functional.mse_loss,
                group=pp_groups[replica],
                timeout=20,
                no_sync=lambda i, ddp=ddp: ddp.no_sync(),
            )
            out: list[Any] = []
            for step in range(3):
                stage.zero_grad(set_to_none=True)
                stage.fail = where if step == 1 and rank == culprit else ""
                try:
                    rt.step(x if pp_rank == 0 else None, y if pp_rank == 1 else None)
                except Exception as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
                    continue
                grads = [p.grad for p in stage.parameters()]
                out.append(
                    max(float((g - w).abs().max()) for g, w in zip(grads, want, strict=True))
                    if all(g is not None for g in grads)
                    else "a parameter got no gradient"
                )
            results[f"{where} on rank {culprit}"] = out
    return results


@pytest.fixture(scope="module")
def sync_pass_fails() -> list[dict[str, list[Any]]]:
    return spawn(_sync_pass_fails, 4, timeout=240)


@pytest.mark.parametrize("culprit", range(4))
@pytest.mark.parametrize("where", WHERE)
def test_the_step_after_a_failed_synchronised_pass_works_on_every_rank(
    sync_pass_fails: list[dict[str, list[Any]]], where: str, culprit: int
) -> None:
    """A DDP whose synchronised forward pass had run and whose backward never began when
    the step failed (stage 0 of both replicas, for a raise in stage 1; the culprit's own,
    for a backward raising before any gradient reached DDP) told its peers nothing, and
    its reducer stayed prepared for that pass. At the next step the skip round found
    nobody had reduced anything, and the first ``no_sync`` backward pass was taken for the
    given-up one: that step failed on every rank too, with DDP's "prior iteration" error
    naming no parameter ("rank 0: 0B1 failed: RuntimeError: Expected to have finished
    reduction in the prior iteration ..."). A peer left waiting in that step's reduction
    waited out the timeout and named the culprit's backward as one that "never reached
    DDP", not its error."""
    for rank, per_case in enumerate(sync_pass_fails):
        out = per_case[f"{where} on rank {culprit}"]
        assert isinstance(out[0], float) and out[0] < 1e-6, (rank, out)
        assert isinstance(out[1], str) and WORDS[where] in out[1], (rank, out)
        # the culprit named as the origin on every rank (the type may be RankError[ValueError])
        assert re.match(rf"RankError(\[\w+\])?: rank {culprit}\b", out[1]), (rank, out)
        assert isinstance(out[2], float) and out[2] < 1e-6, (rank, out)
