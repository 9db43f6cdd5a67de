"""A 2 × 2 layout: two pipeline replicas of two stages, each stage data-parallel with xgrad's DDP."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from failing import Raising  # noqa: E402
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

WIDTH, BATCH, M = 6, 16, 4


def _unpipelined_grads(
    blocks: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> dict[int, list[Any]]:
    """Each block's parameter gradients from the whole batch through the chain, unpipelined
    (then set to None again, for the pipelined run to fill)."""
    out = x
    for b in blocks:
        out = b(out)
    nn.functional.mse_loss(out, y).backward()
    want = {s: [_grad(p).clone() for p in blocks[s].parameters()] for s in range(len(blocks))}
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return want


def _blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def _grad(p: Any) -> Any:
    assert p.grad is not None, "a parameter got no gradient"
    return p.grad


class _Gated(nn.Module):
    """A block whose ``extra`` layer only some replicas use (as a data-dependent branch
    would), and whose ``never`` layer no replica uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra, self.never = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h + self.extra(h) if self.use_extra else h


def _gated_reference(x: torch.Tensor, y: torch.Tensor) -> list[dict[str, Any]]:
    """Each stage's gradients averaged over the two replicas (replica 0 uses ``extra`` in
    stage 0, replica 1 nowhere), computed in one process."""
    torch.manual_seed(0)
    blocks = [_Gated() for _ in range(2)]
    for replica in range(2):
        blocks[0].use_extra = replica == 0
        half = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
        (nn.functional.mse_loss(blocks[1](blocks[0](x[half])), y[half]) / 2).backward()
    return [{n: p.grad for n, p in b.named_parameters()} for b in blocks]


def _gated_error(rank: int, pp: Any, dp: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """REDUCE_GRAD over replicas whose graphs differ: the same sizes reduced, a gradient
    wherever one replica has one, None where none has."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    replica, pp_rank = divmod(rank, 2)
    want = _gated_reference(x, y)
    torch.manual_seed(0)
    blocks = [_Gated() for _ in range(2)]
    blocks[0].use_extra = replica == 0
    half = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    schedule = xp.add_stage_ops(xp.make("zb_h1", 2, M))
    rt = PipelineRuntime(
        schedule, [blocks[pp_rank]], nn.functional.mse_loss, group=pp, timeout=60, dp_group=dp
    )
    rt.step(x[half] if pp_rank == 0 else None, y[half] if pp_rank == 1 else None)
    err = 0.0
    for name, p in blocks[pp_rank].named_parameters():
        w = want[pp_rank][name]
        if w is None or p.grad is None:
            assert w is None and p.grad is None, (name, w, p.grad)
            continue
        err = max(err, float((p.grad - w).norm() / w.norm()))
    return err


def _no_sync(ddps: list[Any]) -> Any:
    """DDP's ``no_sync`` of partition slot i, as the runtime asks for it."""
    return lambda i: ddps[i].no_sync()


def _dp_pp(rank: int, world: int) -> tuple[dict[str, float], str]:
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    # Pipeline groups {0, 1} and {2, 3}; data-parallel groups {0, 2} and {1, 3}.
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    pp, dp = pp_groups[replica], dp_groups[pp_rank]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    half = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    errors: dict[str, float] = {}
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
        schedule = xp.make(name, 2, M, chunks=2)
        blocks = _blocks(schedule.num_stages)
        want = _unpipelined_grads(blocks, x, y)
        stages = schedule.stages_of(pp_rank)
        ddps = [DistributedDataParallel(blocks[s], process_group=dp, timeout=60) for s in stages]
        rt = PipelineRuntime(
            schedule,
            ddps,
            nn.functional.mse_loss,
            group=pp,
            timeout=60,
            no_sync=_no_sync(ddps),
        )
        rt.step(x[half] if pp_rank == 0 else None, y[half] if pp_rank == 1 else None)
        err = 0.0
        for s in stages:
            for p, w in zip(blocks[s].parameters(), want[s], strict=True):
                err = max(err, float((_grad(p) - w).norm() / w.norm()))
        errors[name] = err
    # REDUCE_GRAD with the data-parallel group: split backward works too. A schedule
    # without stage-level actions gets torch's from the runtime (interleaved_zb here):
    # without a REDUCE_GRAD the replicas' gradients stayed local.
    for name in ("zb_h1", "interleaved_zb", "dualpipev"):
        schedule = xp.make(name, 2, M, chunks=2)
        if name != "interleaved_zb":
            schedule = xp.add_stage_ops(schedule)
        blocks = _blocks(schedule.num_stages)
        want = _unpipelined_grads(blocks, x, y)
        stages = schedule.stages_of(pp_rank)
        rt = PipelineRuntime(
            schedule,
            [blocks[s] for s in stages],
            nn.functional.mse_loss,
            group=pp,
            timeout=60,
            dp_group=dp,
        )
        rt.step(
            x[half] if pp_rank == 0 else None,
            y[half] if schedule.placement[-1] == pp_rank else None,
        )
        err = 0.0
        for s in stages:
            for p, w in zip(blocks[s].parameters(), want[s], strict=True):
                err = max(err, float((_grad(p) - w).norm() / w.norm()))
        errors[f"{name}/REDUCE_GRAD"] = err
    errors["zb_h1/REDUCE_GRAD/branch on one replica"] = _gated_error(rank, pp, dp, x, y)
    # DDP reduces in the backward after its synchronised forward: split I/W cannot do that.
    try:
        PipelineRuntime(
            xp.zb_h1(2, M),
            ddps[:1],  # one stage per rank
            nn.functional.mse_loss,
            group=pp,
            no_sync=_no_sync(ddps),
        )
    except ValueError as exc:
        return errors, str(exc)
    return errors, ""


def test_two_by_two_data_and_pipeline_parallel() -> None:
    per_rank = spawn(_dp_pp, 4, timeout=170)
    for rank, (errors, refusal) in enumerate(per_rank):
        assert f"rank {rank % 2}: data parallelism (no_sync) needs full backward" in refusal
        assert set(errors) == {
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "zb_h1/REDUCE_GRAD",
            "interleaved_zb/REDUCE_GRAD",
            "dualpipev/REDUCE_GRAD",
            "zb_h1/REDUCE_GRAD/branch on one replica",
        }
        for name, err in errors.items():
            assert err <= 1e-6, (rank, name, err)


class _Stage(nn.Module):
    """A block that raises in its forward pass, or arms its backward to raise, when told."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.fail = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            self.fail = ""
            raise ValueError("bad batch")
        if self.fail == "backward":
            self.fail = ""
            Raising.armed = True
        return Raising.apply(self.block(x))


def _ddp_stage_fails(rank: int, world: int, where: str, culprit: int, mode: str) -> list[Any]:
    """Pipelines {0, 1} and {2, 3} (data-parallel groups {0, 2} and {1, 3}) of stages
    wrapped in DDP (``no_sync`` but for the last microbatch), or reduced at REDUCE_GRAD
    over ``dp_group`` (``mode``); at step 1 ``culprit``'s stage raises in its forward or
    backward pass. Per step: the error, or the worst gradient error against the
    unpipelined model (both replicas take the same batch)."""
    import os

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    blocks = _blocks(2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    want = _unpipelined_grads(blocks, x, y)[pp_rank]
    stage = _Stage(blocks[pp_rank])
    if mode in ("ddp", "ddp_unused"):
        ddp = DistributedDataParallel(
            stage,
            process_group=dp_groups[pp_rank],
            timeout=20,
            find_unused_parameters=mode == "ddp_unused",
        )
        rt = PipelineRuntime(
            xp.one_f_one_b(2, M),
            [ddp],
            nn.functional.mse_loss,
            group=pp_groups[replica],
            timeout=20,
            no_sync=_no_sync([ddp]),
        )
    else:
        rt = PipelineRuntime(
            xp.add_stage_ops(xp.zb_h1(2, M)),
            [stage],
            nn.functional.mse_loss,
            group=pp_groups[replica],
            timeout=20,
            dp_group=dp_groups[pp_rank],
        )
    out: list[Any] = []
    for step in range(3):
        stage.zero_grad(set_to_none=True)
        here = step == 1 and rank == culprit
        stage.fail = where if here and where != "batch" else ""
        xs = x[:3] if here and where == "batch" else x  # 3 rows: fewer than 4 microbatches
        try:
            rt.step(xs if pp_rank == 0 else None, y if pp_rank == 1 else None)
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            continue
        out.append(
            max(
                float((_grad(p) - w).abs().max())
                for p, w in zip(blocks[pp_rank].parameters(), want, strict=True)
            )
        )
    return out


@pytest.mark.parametrize(
    ("where", "culprit", "mode"),
    [
        ("forward", 0, "ddp"),
        # The DP peer of the failing rank had its last microbatch's forward done, its
        # backward pending: settled at the next step's first forward (a no_sync one), it
        # stayed pending, and the next no_sync forward settled that step too, waiting out
        # the timeout for a peer that skipped nothing ("rank 2 in the other ranks' backward
        # pass of a step whose backward never reached DDP here: timed out after 20 s").
        ("forward", 0, "ddp_unused"),
        ("backward", 1, "ddp"),
        ("batch", 0, "ddp"),
        ("backward", 1, "dp_group"),
        ("batch", 0, "dp_group"),
    ],
)
def test_a_failed_step_reaches_every_replica_and_the_next_step_is_right(
    where: str, culprit: int, mode: str
) -> None:
    """One replica's failed step used to leave the other replica's reduction (DDP's, or
    REDUCE_GRAD's over ``dp_group``) to pair with its next step: silently wrong
    gradients, then a gloo abort. A failure of a DDP in another pipeline was taken for
    one of the pipeline's own (``ValueError: Global rank 0 is not part of group``)."""
    per_rank = spawn(_ddp_stage_fails, 4, args=(where, culprit, mode), timeout=150)
    for rank, out in enumerate(per_rank):
        assert out[0] < 1e-6 and out[2] < 1e-6, (rank, out)
        assert isinstance(out[1], str), (rank, out)
        words = {"forward": "bad batch", "backward": "bad gradient", "batch": "smaller than"}
        assert words[where] in out[1], (rank, out)


def _ddp_then_pipeline(rank: int, world: int) -> tuple[str, float]:
    """Rank 1's DDP backward raises; rank 1 then steps a pipeline (no DDP forward pass,
    which is where a failed backward pass used to be posted)."""
    import os
    import time

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    stage = _Stage(nn.Linear(WIDTH, WIDTH))
    # The raise comes after the outer layer's gradients reached DDP: a pass begun.
    ddp = DistributedDataParallel(nn.Sequential(stage, nn.Linear(WIDTH, WIDTH)), timeout=15)
    rt = PipelineRuntime(xp.gpipe(2, 2), [nn.Linear(WIDTH, WIDTH)], nn.functional.mse_loss)
    x = torch.ones(4, WIDTH)
    stage.fail = "backward" if rank == 1 else ""
    start = time.monotonic()
    try:
        ddp(x).sum().backward()
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    rt.step(x if rank == 0 else None, x if rank == 1 else None)
    return error, took


def test_a_failed_ddp_backward_is_posted_when_the_rank_steps_a_pipeline() -> None:
    per_rank = spawn(_ddp_then_pipeline, 2, timeout=120)
    error, took = per_rank[0]
    assert error.startswith("RankError: rank 1 in backward"), error
    assert took < 8.0, took  # not the DDP's 15 s timeout
    assert "bad gradient" in per_rank[1][0], per_rank[1]


def _pipelined_counts(rank: int, world: int) -> list[int]:
    """Two runtimes over one DDP stage (each rank's stage data-parallel on its own): how
    many drive it, as each is made and dropped."""
    import gc

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    alone = [dist.new_group([r]) for r in range(world)][rank]
    ddp = DistributedDataParallel(nn.Linear(WIDTH, WIDTH), process_group=alone, timeout=15)
    x = torch.ones(4, WIDTH)
    counts = [ddp._grad_hooks.pipelined]
    runtimes = []
    for _ in range(2):
        runtimes.append(PipelineRuntime(xp.gpipe(2, 2), [ddp], nn.functional.mse_loss))
        runtimes[-1].step(x if rank == 0 else None, x if rank == 1 else None)
        counts.append(ddp._grad_hooks.pipelined)
    while runtimes:
        runtimes.pop()
        gc.collect()
        counts.append(ddp._grad_hooks.pipelined)
    return counts


def test_a_ddp_is_a_pipeline_stage_while_a_runtime_drives_it() -> None:
    """A stage's DDP leaves failed steps to the runtime that drives it
    (``GradientHooks.pipelined``); once every such runtime is collected it is a plain
    DDP again (before, it stayed a stage's for good)."""
    assert spawn(_pipelined_counts, 2, timeout=120) == [[0, 1, 2, 1, 0]] * 2


class _Counted(nn.Module):
    """A block that raises at its ``fail_at``-th forward (counted over the steps), and uses
    its ``extra`` layer only when told (unused otherwise, unknown to DDP)."""

    def __init__(self, fail_at: int = 0, use_extra: bool = True) -> None:
        super().__init__()
        self.lin, self.extra = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fail_at, self.use_extra, self.calls = fail_at, use_extra, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("bad batch")
        h = torch.tanh(self.lin(x))
        return h + self.extra(h) if self.use_extra else h


def _ddp_errors(rank: int, world: int) -> dict[str, list[str]]:
    """Pipelines {0, 1} and {2, 3} of DDP stages (data-parallel groups {0, 2} and {1, 3}),
    per step "ok" or the error: rank 0's stage raising in its synchronised forward in step
    1 (DDP names it "forward"; the last microbatch's forward runs without gradients in
    0F3 and again in 0B3, so that is the step's 10th call), then, with fresh stages, rank
    1's leaving a layer unused that rank 3's uses (DDP's "prior iteration" error)."""
    import os

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    x, y = torch.ones(BATCH, WIDTH), torch.zeros(BATCH, WIDTH)
    cases = {
        "sync forward": _Counted(fail_at=2 * (M + 1) if rank == 0 else 0),
        "unused": _Counted(use_extra=rank != 1),
    }
    out: dict[str, list[str]] = {}
    for name, stage in cases.items():
        ddp = DistributedDataParallel(stage, process_group=dp_groups[pp_rank], timeout=20)
        rt = PipelineRuntime(
            xp.one_f_one_b(2, M),
            [ddp],
            nn.functional.mse_loss,
            group=pp_groups[replica],
            checkpoint="never",
            timeout=20,
            no_sync=_no_sync([ddp]),
        )
        out[name] = []
        for _ in range(3 if name == "sync forward" else 2):
            ddp.zero_grad(set_to_none=True)
            try:
                rt.step(x if pp_rank == 0 else None, y if pp_rank == 1 else None)
                out[name].append("ok")
            except Exception as exc:
                out[name].append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.fixture(scope="module")
def ddp_errors() -> list[dict[str, list[str]]]:
    return spawn(_ddp_errors, 4, timeout=150)


def test_a_ddp_failure_names_where_it_reached_the_pipeline(
    ddp_errors: list[dict[str, list[str]]],
) -> None:
    """A DDP's failure relayed by a stage's action was named by the DDP's own place alone
    ("rank 0 in forward: ..." for a failure that surfaced in 0B3): the relay names the
    action too, on each pipeline (rank 2's DDP took rank 0's failure in its 0B3)."""
    for rank, out in enumerate(ddp_errors):
        steps = out["sync forward"]
        assert steps[0] == steps[2] == "ok", (rank, steps)
        by = f"rank {rank // 2 * 2}, in 0B3"
        want = (
            f"RankError: rank 0 in forward: ValueError: bad batch\n(raised in the pipeline by {by})"
        )
        assert steps[1] == want, (rank, steps)


def test_a_ddp_error_reaches_the_peers_with_its_text_rank_and_action(
    ddp_errors: list[dict[str, list[str]]],
) -> None:
    """Rank 1's DDP raises PyTorch's "prior iteration" error in its first forward, 1F0:
    its pipeline peer names rank, action and DDP's text (as it did). Rank 3's DDP raises
    there rank 1's failure of the step before (the unused layer, named), which its
    pipeline used to relay with no word of the action that raised it."""
    prior = "RankError: rank 1: 1F0 failed: RuntimeError: Expected to have finished reduction"
    unused = (
        "RankError: rank 1 in backward (parameters without a gradient): RuntimeError: Some "
        "parameters received no gradient"
    )
    for rank, out in enumerate(ddp_errors):
        first, failed = out["unused"]
        assert first == "ok", (rank, out)
        if rank < 2:
            assert failed.startswith(prior), (rank, failed)
            assert "Parameter indices which did not receive grad for rank 0: 2 3" in failed
        else:
            assert failed.startswith(unused), (rank, failed)
            assert failed.endswith(
                "Parameters which did not receive grad for rank 0: extra.weight, extra.bias\n"
                "(raised in the pipeline by rank 3, in 1F0)"
            ), (rank, failed)
