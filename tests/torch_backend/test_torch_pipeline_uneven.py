"""Uneven microbatches on the pipeline runtime, as torch 2.13's schedules split a batch.

torch's schedules split with ``tensor_split`` (``split_args_kwargs_into_chunks``; the
targets with ``_split_tensor``): 10 rows into 4 microbatches are 3, 3, 2, 2. Its stages do
not cope: ``PipelineStage`` sizes every receive buffer from microbatch 0's shapes, so on
two gloo ranks ScheduleGPipe and Schedule1F1B run the last stage's microbatch 2 on a 3-row
buffer holding the 2 rows sent (a loss that broadcasts says nothing), then stage 0's
backward fails on a 3-row gradient for a 2-row output (with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, a ``PipeliningMetadataError``). Fewer rows than
microbatches: ``Expecting 4 arg_mbs but got 3`` on stage 0's rank, ``Tensor size 3 is
smaller than num_chunks`` on the last stage's.

xgrad refused every batch m did not divide. It now runs them with torch's semantics: its
split, and each microbatch's gradient over m whatever its size (the gradients divided by m
after the backward, as torch's ``perform_reduce_grad``: ``pipeline_scale``). The reference is the
unpipelined model run microbatch by microbatch on torch's split, its gradients accumulated
then divided by m: what torch's schedule computes, checked against torch's own on a batch
it can run (an even one).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _split_tensor,
    merge_chunks,
    split_args_kwargs_into_chunks,
)

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M = 4
T0, T1 = TensorChunkSpec(0), TensorChunkSpec(1)


def _draw(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _data(n: int) -> dict[str, torch.Tensor]:
    return {"x": _draw(1, n, 3), "mask": _draw(2, n, 5), "y": _draw(3, n, 2)}


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * mask


def _parts() -> list[nn.Module]:
    torch.manual_seed(0)
    return [_First(), nn.Linear(5, 2).double()]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _grads(module: nn.Module) -> list[torch.Tensor]:
    found = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return found


def _equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (got, want)
        assert torch.equal(got, want)  # bit for bit
    else:
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            _equal(g, w)


# -- the split ---------------------------------------------------------------------------


def test_batches_split_as_torchs() -> None:
    from xgrad.torch_backend.pipeline_args import split_step
    from xgrad.torch_backend.pipeline_specs import ChunkSpecs

    d = _data(10)
    xs, ys, kws = split_step(
        xp.gpipe(2, M), 0, d["x"], d["y"], {0, 1}, keywords={"mask": d["mask"]}
    )
    args, kwargs = split_args_kwargs_into_chunks((d["x"],), {"mask": d["mask"]}, M)
    _equal(xs, [a[0] for a in args])
    _equal([k["mask"] for k in kws or []], [k["mask"] for k in kwargs])
    _equal(ys, list(_split_tensor(d["y"], T0, M)))
    assert [x.shape[0] for x in xs] == [3, 3, 2, 2]
    # sequence-first, along dim 1 by the specs
    x, mask = _draw(1, 2, 10, 3), _draw(2, 2, 10, 5)
    specs = ChunkSpecs((T1,), {"mask": T1})
    xs, _, kws = split_step(xp.gpipe(2, M), 0, x, None, {0}, keywords={"mask": mask}, specs=specs)
    args, kwargs = split_args_kwargs_into_chunks((x,), {"mask": mask}, M, (T1,), {"mask": T1})
    _equal(xs, [a[0] for a in args])
    _equal([k["mask"] for k in kws or []], [k["mask"] for k in kwargs])


def test_tensors_of_a_rank_that_would_split_differently_are_refused() -> None:
    """torch splits inputs of 10 rows and a keyword of 9 as 3, 3, 2, 2 and 3, 2, 2, 2 and
    pairs them without a word; sizes that m divides split alike in proportion, as before."""
    from xgrad.torch_backend.pipeline_args import split_step

    d = _data(10)
    with pytest.raises(ValueError) as info:
        split_step(xp.gpipe(2, M), 0, d["x"], None, {0}, keywords={"mask": d["mask"][:9]})
    assert str(info.value) == (
        "rank 0: inputs batch size 10 and keyword 'mask' batch size 9 split into "
        "microbatches of different rows ([3, 3, 2, 2] and [3, 2, 2, 2]): microbatch k would "
        "pair rows that do not belong together; give them the same batch size (or both "
        "multiples of the 4 microbatches)"
    )
    # stage 0 and the last stage on one rank (zbv): the targets are checked too
    with pytest.raises(ValueError, match=r"rank 0: targets batch size 9 and inputs batch"):
        split_step(xp.gpipe(2, M), 0, _draw(1, 12, 3), d["y"][:9], {0, 1})
    xs, _, kws = split_step(
        xp.gpipe(2, M), 0, _draw(1, 12, 3), None, {0}, keywords={"m": d["x"][:8]}
    )
    assert [x.shape[0] for x in xs] == [3] * 4 and [k["m"].shape[0] for k in kws or []] == [2] * 4


# -- torch's own stages ------------------------------------------------------------------


def _torchs(rank: int, world: int) -> tuple[str, list[int]]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rows: list[int] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows.append(output.shape[0])  # a loss that broadcasts its target: says nothing
        return ((output - target.mean(0)) ** 2).mean()

    d = _data(10)
    part = _parts()[rank]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, M, loss_fn=loss_fn)
    try:
        if rank == 0:
            schedule.step(d["x"], mask=d["mask"])
        else:
            schedule.step(target=d["y"])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", rows
    return "ok", rows


def test_torchs_stages_fail_on_uneven_microbatches() -> None:
    """What the runtime does better: torch's last stage receives microbatches 2 and 3 (2
    rows each) into microbatch 0's 3-row buffers, and computes their losses on 3 rows; their
    gradients then fail stage 0's backward."""
    from ranks import run_ranks

    results, _ = run_ranks(_torchs, 2, timeout=60)
    zero, one = results[0][1], results[1][1]
    assert one[1][-4:] == [3, 3, 3, 3], results  # microbatches of 3, 3, 2, 2 rows
    assert "Failed to run stage backward" in zero[0], results
    assert "torch.Size([2, 5])" in zero[0] and "torch.Size([3, 5])" in zero[0], zero


class _Whole(nn.Module):
    """Both parts as one stage: torch's pipeline of one stage has no receive buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = _parts()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x, mask))


def _torchs_one_stage(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    found = {}
    for cls in (ScheduleGPipe, Schedule1F1B):
        model = _Whole()
        schedule = cls(PipelineStage(model, 0, 1, torch.device("cpu")), M, loss_fn=_loss)
        d, losses = _data(10), []
        got = schedule.step(d["x"], mask=d["mask"], target=d["y"], losses=losses).detach()
        grads = [_grads(model.first), _grads(model.last)]
        found[cls.__name__] = {"got": got, "losses": losses, "grads": grads}
    return found


def test_torchs_semantics_on_uneven_microbatches_are_the_reference() -> None:
    """Where torch's schedules run uneven microbatches, on one stage (no receive buffer to
    size): its split, per-microbatch losses, and gradients divided by m whatever each
    microbatch's size, as :func:`_reference` computes them, bit for bit."""
    want = _reference(10)
    for got in spawn(_torchs_one_stage, 1, timeout=60)[0].values():
        _equal(got["losses"], want["losses"])
        _equal(got["got"], want["out"])
        _equal(got["grads"], want["grads"])


# -- GPipe and 1F1B: bit for bit ---------------------------------------------------------


def _step(rt: Any, rank: int, d: dict[str, torch.Tensor], outputs: bool) -> dict[str, Any]:
    losses: list[Any] = []
    x, kw = (d["x"], {"mask": d["mask"]}) if rank == 0 else (None, {})
    y = d["y"] if rank == 1 else None
    got = rt.step(x, target=y, losses=losses, return_outputs=True if outputs else None, **kw)
    return {"got": got, "losses": losses}


def _counted() -> list[int]:
    """How many forward descriptions this process sends (pipeline_comm sends one for a
    microbatch whose layout differs from its edge's last)."""
    from xgrad.torch_backend import pipeline_wire

    count = [0]
    original = pipeline_wire.Description.to_bytes

    def to_bytes(self: Any) -> bytes:
        count[0] += 1
        return original(self)

    pipeline_wire.Description.to_bytes = to_bytes  # type: ignore[method-assign]
    return count


#: per step, the batch size and whether it returns the outputs (else the loss).
STEPS = [(10, True), (9, False), (12, True), (10, True), (10, False)]


def _gpipe_1f1b(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from xgrad.torch_backend.pipeline import PipelineRuntime

    sent = _counted()
    found: dict[str, Any] = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        part = _parts()[rank]
        rt = PipelineRuntime(xp.make(name, 2, M), [part], _loss, timeout=20)
        steps = []
        for n, outputs in STEPS:
            before = sent[0]
            out = _step(rt, rank, _data(n), outputs)
            steps.append({**out, "grads": _grads(part), "sent": sent[0] - before})
        # torch's own schedule, on a batch it can run (12 rows: 3 each)
        theirs = _parts()[rank]
        schedule = cls(PipelineStage(theirs, rank, 2, torch.device("cpu")), M, loss_fn=_loss)
        d, losses = _data(12), []
        if rank == 0:
            got = schedule.step(d["x"], mask=d["mask"])
        else:
            got = schedule.step(target=d["y"], losses=losses).detach()
        found[name] = {"ours": steps, "torch": {"got": got, "losses": losses}}
        found[name]["torch"]["grads"] = _grads(theirs)
    return found


def _reference(n: int) -> dict[str, Any]:
    """torch's semantics: its split, each microbatch's loss, the gradients accumulated
    then divided by m; the loss xgrad's step returns, the sum of the losses over m."""
    first, last = _parts()
    d = _data(n)
    args, kwargs = split_args_kwargs_into_chunks((d["x"],), {"mask": d["mask"]}, M)
    losses, outs, total = [], [], None
    for (x,), kw, y in zip(args, kwargs, _split_tensor(d["y"], T0, M), strict=True):
        out = last(first(x, **kw))
        loss = _loss(out, y)
        loss.backward()
        losses.append(loss.detach())
        outs.append(out.detach())
        total = loss.detach() / M if total is None else total + loss.detach() / M
    for p in [*first.parameters(), *last.parameters()]:
        assert p.grad is not None
        p.grad.div_(M)
    grads = [_grads(first), _grads(last)]
    return {"losses": losses, "out": merge_chunks(outs, None), "loss": total, "grads": grads}


def test_gpipe_and_1f1b_give_torchs_losses_gradients_and_outputs_bit_for_bit() -> None:
    ranks = spawn(_gpipe_1f1b, 2, timeout=150)
    even = _reference(12)
    for name in ("gpipe", "1f1b"):
        for rank in (0, 1):
            theirs = ranks[rank][name]["torch"]  # the reference is what torch computes
            _equal(theirs["grads"], even["grads"][rank])
            if rank == 1:
                _equal(theirs["losses"], even["losses"])
                _equal(theirs["got"], even["out"])
            for (n, outputs), ours in zip(STEPS, ranks[rank][name]["ours"], strict=True):
                want = _reference(n)
                _equal(ours["grads"], want["grads"][rank])
                if rank == 0:
                    assert ours["got"] is None and ours["losses"] == []
                    continue
                _equal(ours["losses"], want["losses"])
                _equal(ours["got"], want["out"] if outputs else want["loss"])
            # A layout is remembered per edge and microbatch: a forward message sends its
            # description only where its microbatch's rows changed since the last step
            # (10 rows: 3, 3, 2, 2, then 9: 3, 2, 2, 2, ...); one per edge and step, had
            # it been the edge's last.
            sent = [step["sent"] for step in ranks[rank][name]["ours"]]
            assert sent == ([4, 1, 3, 2, 0] if rank == 0 else [0] * 5), (name, rank, sent)


# -- the other schedules: the unpipelined model, microbatch by microbatch ------------------

#: (schedule, microbatches, rows): uneven splits, m = 3 too (1/3 is not exact: close).
OTHERS = [
    *((name, M, 10) for name in sorted(xp.SCHEDULES) if name not in ("gpipe", "1f1b")),
    ("1f1b", 3, 7),
    ("interleaved_1f1b", 3, 8),
]


def _blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(n)]


def _others(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    found = {}
    for name, m, n in OTHERS:
        schedule = xp.make(name, 2, m)
        parts = _blocks(schedule.num_stages)
        mine = [parts[s] for s in schedule.stages_of(rank)]
        x, y = _draw(1, n, 4), _draw(2, n, 4)
        first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
        rt = PipelineRuntime(schedule, mine, _loss, timeout=20)
        losses: list[Any] = []
        loss = rt.step(x if first else None, y if last else None, losses=losses)
        grads = {s: _grads(parts[s]) for s in schedule.stages_of(rank)}
        out = rt.eval(x if first else None, y if last else None)
        found[f"{name}/{m}"] = {"loss": loss, "losses": losses, "grads": grads, "eval": out}
    return found


def _unpipelined(parts: list[nn.Module], m: int, n: int) -> dict[str, Any]:
    x, y = _draw(1, n, 4), _draw(2, n, 4)
    losses, outs, total = [], [], None
    for xk, yk in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        out = xk
        for part in parts:
            out = part(out)
        loss = _loss(out, yk)
        (loss / m).backward()  # torch's scaling: 1/m whatever the microbatch's size
        losses.append(loss.detach())
        outs.append(out.detach())
        total = loss.detach() / m if total is None else total + loss.detach() / m
    grads = [_grads(part) for part in parts]
    return {"loss": total, "losses": losses, "grads": grads, "out": torch.cat(outs)}


def test_interleaved_and_zero_bubble_schedules_equal_the_unpipelined_model() -> None:
    """Every schedule of two ranks, zbv's and dualpipev's with stage 0 and the last stage
    on one rank, on uneven microbatches: the unpipelined model's losses and gradients with
    each microbatch's loss over m, as torch's, and eval's merged outputs."""
    ranks = spawn(_others, 2, timeout=240)
    close = {"rtol": 1e-12, "atol": 1e-15}
    for name, m, n in OTHERS:
        schedule = xp.make(name, 2, m)
        want = _unpipelined(_blocks(schedule.num_stages), m, n)
        key = f"{name}/{m}"
        last = ranks[schedule.placement[-1]][key]
        torch.testing.assert_close(last["loss"], want["loss"], **close)
        _equal(last["losses"], want["losses"])  # the forwards are the same operations
        _equal(last["eval"], want["out"])
        for rank in (0, 1):
            for s, grads in ranks[rank][key]["grads"].items():
                torch.testing.assert_close(grads, want["grads"][s], **close, msg=key)


# -- what torch fails on: refused by name, before anything is sent -------------------------


def _bad(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = _parts()[rank]
    rt = PipelineRuntime(xp.make("1f1b", 2, M), [part], _loss, timeout=10)
    d = _data(10)
    steps: list[tuple[int, int, int]] = [  # rows of the inputs, the mask, the targets
        (3, 3, 10),  # the first step (before the private group): fewer rows than m
        (10, 10, 10),
        (10, 10, 2),  # the targets, on the last stage's rank
        (10, 9, 10),  # a keyword that splits otherwise than the inputs
        (0, 0, 10),
        (10, 10, 9),  # targets that split otherwise than the inputs, on another rank
        (9, 9, 9),
    ]
    outcome = []
    for rows, mask, targets in steps:
        kw = {"mask": d["mask"][:mask]} if rank == 0 else {}
        try:
            x, y = (d["x"][:rows], None) if rank == 0 else (None, d["y"][:targets])
            rt.step(x, target=y, **kw)
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        part.zero_grad(set_to_none=True)
    return outcome


def test_what_torch_fails_on_is_refused_naming_it_on_every_rank() -> None:
    """Fewer rows than microbatches (torch: ``Expecting 4 arg_mbs but got 3`` on one rank,
    an ``AssertionError`` on the other) and tensors that would not pair row for row (torch:
    nothing said): raised on the rank given them, before it sends anything; its peer's
    step fails naming that rank at once, and the next step works. Targets that split
    otherwise than the inputs of another rank: the last stage's loss names the rows."""
    from ranks import run_ranks

    results, _ = run_ranks(_bad, 2, timeout=60)
    zero, one = results[0][1], results[1][1]
    smaller = (
        "is smaller than the 4 microbatches: every microbatch needs at least one row (give "
        "at least 4, or fewer microbatches)"
    )
    assert zero[0] == f"ValueError: rank 0: inputs batch size 3 {smaller}", zero
    assert one[2] == f"ValueError: rank 1: targets batch size 2 {smaller}", one
    assert zero[3] == (
        "ValueError: rank 0: inputs batch size 10 and keyword 'mask' batch size 9 split into "
        "microbatches of different rows ([3, 3, 2, 2] and [3, 2, 2, 2]): microbatch k would "
        "pair rows that do not belong together; give them the same batch size (or both "
        "multiples of the 4 microbatches)"
    ), zero
    assert zero[4] == f"ValueError: rank 0: inputs batch size 0 {smaller}", zero
    for k in (0, 3, 4):
        assert one[k].startswith(f"RankError: rank 0: step failed: {zero[k]}"), one
    assert zero[2].startswith(f"RankError: rank 1: step failed: {one[2]}"), zero
    # The last stage's rank cannot see the inputs: its loss names the microbatch's rows.
    said = (
        "rank 1: 1F1 failed: ValueError: loss_fn(output, target): the microbatch's output "
        "has 3 rows and its target 2: inputs and targets must have the same batch size "
        "(output shape (3, 2); target shape (2, 2))"
    )
    assert one[5] == f"RankError[ValueError]: {said}", one
    assert zero[5] == f"RankError: {said}", zero
    assert zero[1] == zero[6] == one[1] == one[6] == "ok", results


# -- data-parallel replicas of the pipeline ------------------------------------------------


#: per replica, its batch's rows: each split unevenly, and otherwise than the other's.
REPLICA_ROWS = (10, 7)


def _replicas(rank: int, world: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    part = _parts()[stage]
    rt = PipelineRuntime(
        xp.make("1f1b", 2, M), [part], _loss, group=pipes[replica], dp_group=dps[stage], timeout=20
    )
    d = _data(20)
    at = sum(REPLICA_ROWS[:replica])
    rows = slice(at, at + REPLICA_ROWS[replica])
    kw = {"mask": d["mask"][rows]} if stage == 0 else {}
    rt.step(d["x"][rows] if stage == 0 else None, target=d["y"][rows] if stage == 1 else None, **kw)
    return _grads(part)


def test_data_parallel_replicas_average_their_uneven_steps() -> None:
    """Two replicas of the two-stage pipeline (``dp_group``), with 10 and 7 rows (3, 3, 2,
    2 and 2, 2, 2, 1): each stage's gradients are the mean of the replicas' torch-semantics
    gradients, bit for bit (a sum of two, halved)."""
    got = spawn(_replicas, 4, timeout=120)
    first, last = _parts()
    d = _data(20)
    wants = []
    at = 0
    for n in REPLICA_ROWS:
        losses = []
        rows = slice(at, at + n)
        at += n
        args, kwargs = split_args_kwargs_into_chunks((d["x"][rows],), {"mask": d["mask"][rows]}, M)
        for (x,), kw, y in zip(args, kwargs, _split_tensor(d["y"][rows], T0, M), strict=True):
            losses.append(_loss(last(first(x, **kw)), y))
        for loss in losses:
            loss.backward()
        for p in [*first.parameters(), *last.parameters()]:
            assert p.grad is not None
            p.grad.div_(M)
        wants.append([_grads(first), _grads(last)])
    for rank in range(4):
        stage = rank % 2
        want = [(a + b) / 2 for a, b in zip(wants[0][stage], wants[1][stage], strict=True)]
        _equal(got[rank], want)
