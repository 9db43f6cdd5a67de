"""The division of a pipeline step's gradients by m, as torch 2.13's schedules divide them.

torch's schedules (``scale_grads=True``) run each microbatch's backward from its loss as
it is and divide each stage's parameter gradients by m after the stage's last backward
(``_PipelineStageBase.scale_grads``, from ``perform_reduce_grad``: after the reduction of
a data-parallel stage). The runtime divided each loss by m before its backward instead:
equal where m is a power of two, a few units in the last place apart elsewhere (m = 3, 5,
6). On two gloo ranks, each running torch's schedule and then xgrad's on the same stages,
weights and batch: losses, gradients and outputs bit for bit. And where torch does worse
(it divides what earlier steps accumulated in ``.grad`` too), the runtime does not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.pipeline_bench import TORCH_SCHEDULES
from xgrad.torch_backend.spawn import spawn

#: xgrad's schedule -> torch's (the bench's map); the multi-stage ones with 2 stages per rank.
TORCH = TORCH_SCHEDULES

#: (schedule, m, dtype): m not a power of two, as each schedule takes it on 2 ranks (the
#: interleaved ones need m a multiple of max(1, m // 2): not 5; dualpipev m >= 4 stages).
CASES = [
    *(
        (name, m, dtype)
        for name in ("gpipe", "1f1b")
        for m in (3, 6, 5)
        for dtype in ("f64", "f32")
    ),
    *(
        (name, m, "f64")
        for name in ("interleaved_1f1b", "interleaved_zb", "looped_bfs")
        for m in (3, 6)
    ),
    *(("zbv", m, "f64") for m in (3, 5)),
    ("dualpipev", 5, "f64"),
    ("zbv", 6, "f32"),
    ("interleaved_zb", 3, "f32"),
]
DTYPES = {"f64": torch.float64, "f32": torch.float32}


def _blocks(n: int, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(dtype) for _ in range(n)]


def _batch(m: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2 * m, 4, generator=g), torch.randn(2 * m, 4, generator=g)
    return x.to(dtype), y.to(dtype)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _grads(parts: list[nn.Module], stages: list[int]) -> dict[int, list[torch.Tensor]]:
    found = {s: [p.grad.clone() for p in parts[s].parameters()] for s in stages}
    for s in stages:
        parts[s].zero_grad(set_to_none=True)
    return found


def _torchs(
    name: str, m: int, parts: list[nn.Module], rank: int, batch: Any, **kw: Any
) -> dict[str, Any]:
    """One step of torch's schedule ``name`` on ``parts`` (this rank's stages)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    schedule = xp.make(name, 2, m)
    mine, n = schedule.stages_of(rank), schedule.num_stages
    stages = [PipelineStage(parts[s], s, n, torch.device("cpu")) for s in mine]
    theirs = getattr(schedules, TORCH[name])(
        stages[0] if n == 2 else stages, m, loss_fn=_loss, **kw
    )
    x, y = batch
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    losses: list[Any] = []
    args = (x,) if first else ()
    got = theirs.step(*args, **({"target": y, "losses": losses} if last else {}))
    return {"out": got.detach() if last else None, "losses": losses}


def _ours(
    name: str, m: int, parts: list[nn.Module], rank: int, batch: Any, **kw: Any
) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 2, m)
    mine = schedule.stages_of(rank)
    rt = PipelineRuntime(schedule, [parts[s] for s in mine], _loss, timeout=30, **kw)
    x, y = batch
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    losses: list[Any] = []
    args = (x if first else None, y if last else None)
    out = rt.step(*args, losses=losses, return_outputs=True)
    return {"out": out, "losses": losses, "rt": rt}


def _against_torch(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, m, dtype_name in CASES:
        dtype = DTYPES[dtype_name]
        schedule = xp.make(name, 2, m)
        mine = schedule.stages_of(rank)
        batch = _batch(m, dtype)
        theirs_parts = _blocks(schedule.num_stages, dtype)
        theirs = _torchs(name, m, theirs_parts, rank, batch)
        theirs["grads"] = _grads(theirs_parts, mine)
        parts = _blocks(schedule.num_stages, dtype)
        ours = _ours(name, m, parts, rank, batch)
        ours["grads"] = _grads(parts, mine)
        # The loss step() returns by default: each microbatch's over m, summed in order.
        ours["loss"] = ours.pop("rt").step(batch[0], batch[1])
        found[f"{name}/{m}/{dtype_name}"] = {"torch": theirs, "ours": ours}
    # scale_grads=False (a summed loss): nothing divided, as torch's.
    theirs_parts, parts = _blocks(2, torch.float64), _blocks(2, torch.float64)
    batch = _batch(3, torch.float64)
    _torchs("1f1b", 3, theirs_parts, rank, batch, scale_grads=False)
    _ours("1f1b", 3, parts, rank, batch, scale_grads=False)
    found["unscaled"] = {"torch": _grads(theirs_parts, [rank]), "ours": _grads(parts, [rank])}
    return found


def _equal(got: Any, want: Any, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, what
        assert torch.equal(got, want), (what, (got - want).abs().max())  # bit for bit
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), what
        for k in want:
            _equal(got[k], want[k], f"{what}[{k}]")
    else:
        assert len(got) == len(want), what
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _equal(g, w, f"{what}[{k}]")


def test_every_schedule_gives_torchs_gradients_bit_for_bit_where_m_is_not_a_power_of_two() -> None:
    """GPipe and 1F1B (m = 3, 6, 5; float64 and float32), the interleaved, looped and zero
    bubble ones with 2 stages per rank (W passes too): gradients, per-microbatch losses
    and merged outputs equal torch's, and the loss ``step`` returns is the sum of each
    microbatch's over m, as it was."""
    ranks = spawn(_against_torch, 2, timeout=240)
    for name, m, dtype_name in CASES:
        key = f"{name}/{m}/{dtype_name}"
        last = xp.make(name, 2, m).placement[-1]
        for rank in (0, 1):
            theirs, ours = ranks[rank][key]["torch"], ranks[rank][key]["ours"]
            _equal(ours["grads"], theirs["grads"], f"{key} rank {rank} grads")
            if rank != last:
                continue
            _equal(ours["losses"], theirs["losses"], f"{key} losses")
            _equal(ours["out"], theirs["out"], f"{key} outputs")
            total = None
            for loss in ours["losses"]:
                total = loss / m if total is None else total + loss / m
            _equal(ours["loss"], total, f"{key} step's loss")
    for rank in (0, 1):
        _equal(ranks[rank]["unscaled"]["ours"], ranks[rank]["unscaled"]["torch"], "unscaled")


# -- what torch does worse -----------------------------------------------------------------


def _accumulated(rank: int, world: int) -> dict[str, Any]:
    m = 3
    one, two = _batch(m, torch.float64, 1), _batch(m, torch.float64, 2)
    found: dict[str, Any] = {}
    for who, run in (("torch", _torchs), ("ours", _ours)):
        each = []
        for batch in (one, two):  # each step alone, from no gradient
            parts = _blocks(2, torch.float64)
            run("1f1b", m, parts, rank, batch)
            each.append(_grads(parts, [rank])[rank])
        parts = _blocks(2, torch.float64)
        for batch in (one, two):  # two steps, no zero_grad between them
            run("1f1b", m, parts, rank, batch)
        found[who] = {"each": each, "both": _grads(parts, [rank])[rank]}
    return found


def test_steps_without_zero_grad_add_each_steps_gradient() -> None:
    """torch divides the whole ``.grad`` at each step, what the earlier steps left there
    too: two steps give the first one's gradient over m plus the second's (torchtitan's
    issue 1733). The runtime's gradient of two steps is the sum of each one's (each
    torch's, bit for bit)."""
    for rank, found in enumerate(spawn(_accumulated, 2, timeout=120)):
        theirs, ours = found["torch"], found["ours"]
        _equal(ours["each"], theirs["each"], f"rank {rank}: each step")
        first, second = theirs["each"]
        _equal(ours["both"], [a + b for a, b in zip(first, second, strict=True)], "both")
        torchs = [a / 3 + b for a, b in zip(first, second, strict=True)]
        torch.testing.assert_close(theirs["both"], torchs, rtol=1e-13, atol=1e-16)


class _Failing(nn.Module):
    """The last stage's block, raising in its forward of microbatch ``at`` (its count)."""

    def __init__(self, block: nn.Module, at: int) -> None:
        super().__init__()
        self.block, self.at, self.calls = block, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("boom in the last stage")
        return self.block(x)


def _failed(rank: int, world: int) -> dict[str, Any]:
    from xgrad.failure import RankError
    from xgrad.torch_backend.pipeline import PipelineRuntime

    m = 3
    x, y = _batch(m, torch.float64)
    parts = _blocks(2, torch.float64)
    held = [torch.full_like(p, 0.25) for p in parts[rank].parameters()]
    for p, g in zip(parts[rank].parameters(), held, strict=True):
        p.grad = g.clone()
    # 1F1B's last stage runs F0 B0 F1 B1 F2: its third forward raises after two backwards.
    module = _Failing(parts[1], 3) if rank == 1 else parts[0]
    rt = PipelineRuntime(xp.one_f_one_b(2, m), [module], _loss, checkpoint="never", timeout=30)
    try:
        rt.step(x if rank == 0 else None, y if rank == 1 else None)
        raise AssertionError("the step did not fail")
    except RankError as exc:
        error = str(exc)
    after = [p.grad.clone() for p in parts[rank].parameters()]
    # Microbatches 0 and 1 alone, undivided, from no gradient: what the step had added.
    reference = _blocks(2, torch.float64)
    for xk, yk in list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))[:2]:
        _loss(reference[1](reference[0](xk)), yk).backward()
    partial = [p.grad for p in reference[rank].parameters()]
    parts[rank].zero_grad(set_to_none=True)
    module.at = 0
    rt.step(x if rank == 0 else None, y if rank == 1 else None)  # the next step works
    theirs = _blocks(2, torch.float64)
    _torchs("1f1b", m, theirs, rank, (x, y))
    return {
        "error": error,
        "after": after,
        "want": [g + d for g, d in zip(held, partial, strict=True)],
        "next": _grads(parts, [rank]),
        "torch": _grads(theirs, [rank]),
    }


def test_a_failed_step_puts_back_what_grad_held() -> None:
    """A step sets ``.grad`` aside before its first backward and adds it back after the
    division; one that fails adds it back too (its partial, undivided gradients stay, as
    before: zero them before retrying), and the next step is torch's again."""
    found = spawn(_failed, 2, timeout=120)
    assert "boom in the last stage" in found[1]["error"], found[1]["error"]
    _equal(found[1]["after"], found[1]["want"], "rank 1 after the failure")
    for rank in (0, 1):
        _equal(found[rank]["next"], found[rank]["torch"], f"rank {rank}: the next step")


def _tied(rank: int, world: int) -> dict[str, Any]:
    """zbv puts stages 0 and 3 on rank 0: their first layers share one weight (tied)."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    m = 3
    parts = _blocks(4, torch.float64)
    parts[3][0].weight = parts[0][0].weight
    x, y = _batch(m, torch.float64)
    schedule = xp.make("zbv", 2, m)
    mine = schedule.stages_of(rank)
    rt = PipelineRuntime(schedule, [parts[s] for s in mine], _loss, timeout=30)
    rt.step(x if rank == 0 else None, y if rank == 0 else None)
    return {"weight": parts[0][0].weight.grad if rank == 0 else None}


def test_a_parameter_two_partitions_share_is_divided_once() -> None:
    """A weight tied between stages 0 and 3 (both on rank 0): divided by m once, after the
    later's last backward (torch divides it at each stage: m times too small)."""
    got = spawn(_tied, 2, timeout=90)[0]["weight"]
    parts = _blocks(4, torch.float64)
    parts[3][0].weight = parts[0][0].weight
    x, y = _batch(3, torch.float64)
    for xk, yk in zip(x.tensor_split(3), y.tensor_split(3), strict=True):
        out = xk
        for part in parts:
            out = part(out)
        (_loss(out, yk) / 3).backward()
    torch.testing.assert_close(got, parts[0][0].weight.grad, rtol=1e-13, atol=1e-16)


# -- data-parallel replicas: the reduction first, then the division, as torch's -----------


def _replicas(rank: int, world: int, how: str) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    part = _blocks(2, torch.float64)[stage]
    seen: list[list[torch.Tensor]] = []

    def reduce_grad(index: int) -> None:  # what a user's reduction is given: the sums
        grads = [p.grad for p in part.parameters()]
        seen.append([g.clone() for g in grads])
        for g in grads:
            dist.all_reduce(g, group=dps[stage])
            g /= 2

    kw: dict[str, Any] = {"dp_group": dps[stage]} if how == "dp_group" else {}
    if how == "reduce_grad":
        kw["reduce_grad"] = reduce_grad
    module: nn.Module = part
    if how == "ddp":  # torch's, its gradients views of its buckets (zeroed in place)
        ddp = nn.parallel.DistributedDataParallel(
            part, process_group=dps[stage], gradient_as_bucket_view=True
        )
        module, kw["no_sync"] = ddp, lambda index: ddp.no_sync()
    rt = PipelineRuntime(xp.make("1f1b", 2, 3), [module], _loss, group=pipes[replica], **kw)
    x, y = _batch(3, torch.float64, seed=1 + replica)
    rt.step(x if stage == 0 else None, y if stage == 1 else None)
    found = {"grads": [p.grad.clone() for p in part.parameters()], "seen": seen}
    if how == "ddp":  # a second step without zero_grad adds its gradient
        rt.step(x if stage == 0 else None, y if stage == 1 else None)
        found["twice"] = [p.grad.clone() for p in part.parameters()]
    return found


def test_replicas_reduce_the_sums_then_divide_by_m() -> None:
    """Two replicas of a two-stage pipeline (m = 3), averaged by ``dp_group``, by a
    ``reduce_grad`` of the user's or by torch's DDP around each stage: each stage's
    gradient is the mean of the replicas' undivided sums, then divided by m (torch's
    ``perform_reduce_grad`` order), bit for bit; ``reduce_grad`` is given the sums. A
    second step adds its own (DDP's gradients are views of its buckets, set aside and
    zeroed in place)."""
    sums = []
    for replica in (0, 1):
        parts = _blocks(2, torch.float64)
        x, y = _batch(3, torch.float64, seed=1 + replica)
        for xk, yk in zip(x.tensor_split(3), y.tensor_split(3), strict=True):
            _loss(parts[1](parts[0](xk)), yk).backward()
        sums.append([[p.grad for p in part.parameters()] for part in parts])
    for how in ("dp_group", "reduce_grad", "ddp"):
        for rank, found in enumerate(spawn(_replicas, 4, args=(how,), timeout=120)):
            replica, stage = divmod(rank, 2)
            want = [(a + b) / 2 / 3 for a, b in zip(sums[0][stage], sums[1][stage], strict=True)]
            _equal(found["grads"], want, f"{how} rank {rank}")
            if how == "ddp":
                _equal(found["twice"], [w + w for w in want], f"rank {rank}: two steps")
            if how == "reduce_grad":
                _equal(found["seen"], [sums[replica][stage]], f"rank {rank}: reduce_grad's")


# -- the division alone (no process group) -------------------------------------------------


def test_the_step_sets_grad_aside_divides_after_the_last_backward_and_unhooks() -> None:
    """One stage, m = 3 (GPipe: B2 last): ``.grad`` held before the step is set aside and
    added back after the division; a step tensor that requires grad (given whole to each
    microbatch, as a replicated keyword: one hook) gets each microbatch's gradient over m,
    and keeps no hook after the step. A step abandoned after two backwards puts back what
    it set aside, with the two undivided gradients, and unhooks too."""
    from xgrad.torch_backend.pipeline_scale import StepScaling, scale_points

    actions = xp.make("gpipe", 1, 3).actions[0]
    assert scale_points(actions, {0: 0}, {}, reduces=False) == {0: 5}
    x, y = _batch(3, torch.float64)
    for ran in (3, 2):
        lin = _blocks(1, torch.float64)[0]
        held = [torch.full_like(p, 0.5) for p in lin.parameters()]
        for p, g in zip(lin.parameters(), held, strict=True):
            p.grad = g.clone()
        scale = torch.full((4,), 2.0, dtype=torch.float64, requires_grad=True)
        scaling = StepScaling(3, actions, {0: 5}, [lin])
        scaling.begin(([scale] * 3, None))
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in lin.parameters())
        reference = _blocks(1, torch.float64)[0]
        whole = torch.full((4,), 2.0, dtype=torch.float64, requires_grad=True)
        batches = list(zip(x.tensor_split(3), y.tensor_split(3), strict=True))[:ran]
        for k, (xk, yk) in enumerate(batches):
            _loss(lin(xk * scale), yk).backward()
            scaling.after(actions[3 + k])
            _loss(reference(xk * whole), yk).backward()
        if ran < 3:
            assert scale._backward_hooks
            scaling.abandon()
        assert not scale._backward_hooks
        sums = [p.grad for p in reference.parameters()]
        want = [g + (s / 3 if ran == 3 else s) for g, s in zip(held, sums, strict=True)]
        _equal([p.grad for p in lin.parameters()], want, f"{ran} backwards")
        assert whole.grad is not None and scale.grad is not None
        torch.testing.assert_close(scale.grad, whole.grad / 3, rtol=1e-14, atol=0)
