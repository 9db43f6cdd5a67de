"""The step's own data that a loss or a stage's forward reads whole, under ``dp_group``.

A loss closing over the input batch ``x`` (a reconstruction term), a stage's forward
reading it, a loss reading the whole targets, or a tensor computed from them: the walk
for what a stage reads of its own (``pipeline_loss_params``) found it as a weight. Under
``dp_group`` its gradient was averaged over the replicas where m is a power of two, and
refused as "divided twice" where not (one rank a pipeline); on a rank not given the batch
(the last stage's of a two-rank pipeline) averaged at every m. Data-parallel training
leaves an input's gradient on its replica: now what the step was given on a rank, and the
leaves it was computed from, are that replica's data (``pipeline_step_data``), their
gradients the unpipelined model's on the replica's batch, each microbatch's divided by m
as it is read; and a tensor that differs between the replicas but is not known as data
there is refused by shape rather than averaged.

One spawn of four gloo ranks: pairs {0, 1} and {2, 3} of one-rank pipelines, each pair
two replicas; then two replicas of a two-rank pipeline (pipelines {0, 1} and {2, 3},
``dp_group`` {0, 2} and {1, 3}). Against the unpipelined model on each replica's batch,
parameters averaged over the replicas, the data's gradients local, to 1e-12 in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grads_close import assert_close
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: "loss": the loss closes over the batch; "stage": the last stage's forward reads it;
#: "target": the loss reads the whole targets (they require grad); "upstream": the batch
#: given is computed from two leaves (``base * scale``), and the loss reads it whole.
READS = ("loss", "stage", "target", "upstream")
#: one rank a pipeline: one stage (gpipe, 1f1b) or two (interleaved_1f1b, zbv: I and W
#: split); (schedule, m, checkpoint)
ONE_RANK = [
    *((name, m, "never") for name in ("gpipe", "1f1b", "interleaved_1f1b", "zbv") for m in (3, 4)),
    ("1f1b", 3, "always"),
    ("zbv", 3, "always"),
]
#: two ranks a pipeline, zb_h1's I and W split; the batch given on both ranks
TWO_RANKS = [(name, m) for name in ("gpipe", "1f1b", "zb_h1") for m in (3, 4)]


class Stage(nn.Module):
    """A tanh layer, plus the mean of ``read[0]`` where it holds a tensor (not registered:
    a plain list, as a closure would hold it)."""

    def __init__(self, lin: nn.Linear, read: list[Any]) -> None:
        super().__init__()
        self.lin = lin
        self.read = read

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        return h if self.read[0] is None else h + 0.1 * self.read[0].mean(0)


def _data(m: int, replica: int, reads: str) -> dict[str, torch.Tensor]:
    """The replica's batch (its own values): ``x`` given, ``t`` the targets; the leaves
    that require grad by name."""
    g = torch.Generator().manual_seed(10 + replica)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    if reads == "target":
        t.requires_grad_()
    if reads == "upstream":
        scale = torch.rand(4, generator=g, dtype=torch.float64).add(0.5).requires_grad_()
        return {"x": x * scale, "t": t, "base": x, "scale": scale}
    return {"x": x, "t": t, "base": x}


def _model(n: int, reads: str, d: dict[str, torch.Tensor]) -> tuple[list[Stage], Any, Any]:
    """``n`` stages, the tensors they train by name (a learnt temperature the loss reads:
    a weight) and the loss."""
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4).double() for _ in range(n)]
    read = [None] * (n - 1) + [d["x"] if reads == "stage" else None]  # the last stage's
    stages = [Stage(lin, [r]) for lin, r in zip(lins, read, strict=True)]
    temp = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    whole = {"loss": d["x"], "upstream": d["x"], "target": d["t"]}.get(reads)

    def loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = nn.functional.mse_loss(y * temp, t)
        return out if whole is None else out + 0.1 * (y.mean() * whole).pow(2).mean()

    named = {f"lin{s}.{k}": p for s, lin in enumerate(lins) for k, p in lin.named_parameters()}
    return stages, {**named, "temp": temp}, loss


def _grads(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros_like(v) if v.grad is None else v.grad.clone()
        for k, v in tensors.items()
        if v.requires_grad and v.is_leaf
    }


def _reference(n: int, m: int, reads: str) -> tuple[dict[str, torch.Tensor], ...]:
    """Per replica, the unpipelined model's gradients on its batch (the mean of its
    microbatches' losses), the weights' averaged over the two replicas."""
    found = []
    for replica in (0, 1):
        d = _data(m, replica, reads)
        stages, weights, loss = _model(n, reads, d)
        total = torch.zeros((), dtype=torch.float64)
        for xk, tk in zip(d["x"].tensor_split(m), d["t"].tensor_split(m), strict=True):
            for stage in stages:
                xk = stage(xk)
            total = total + loss(xk, tk) / m
        total.backward()
        found.append((_grads(weights), _grads(d)))
    mean = {k: (found[0][0][k] + found[1][0][k]) / 2 for k in found[0][0]}
    return tuple({**mean, **data} for _, data in found)


def _one_rank(replica: int, dp: Any, pipe: Any, case: tuple[str, int, str], reads: str) -> Any:
    """This rank as one replica of a one-rank pipeline: two steps, no zero_grad between."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    name, m, checkpoint = case
    schedule = xp.make(name, 1, m)
    d = _data(m, replica, reads)
    stages, weights, loss = _model(schedule.num_stages, reads, d)
    rt = PipelineRuntime(
        schedule, stages, loss, group=pipe, dp_group=dp, timeout=10, checkpoint=checkpoint
    )
    found = []
    for _ in range(2):
        try:
            rt.step(d["x"], d["t"])
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        found.append(_grads({**weights, **d}))
    return found


def _two_ranks(rank: int, pipes: list[Any], dps: list[Any], name: str, m: int, give: bool) -> Any:
    """This rank in one replica of a two-rank pipeline; the batch given on both ranks
    (``give``), else on stage 0's alone."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    replica, mine = divmod(rank, 2)
    schedule = xp.make(name, 2, m)
    d = _data(m, replica, "loss")
    stages, weights, loss = _model(schedule.num_stages, "loss", d)
    parts = [stages[s] for s in schedule.stages_of(mine)]
    rt = PipelineRuntime(
        schedule, parts, loss, group=pipes[replica], dp_group=dps[mine], timeout=10
    )
    last = schedule.placement[-1] == mine
    try:
        rt.step(d["x"] if give or mine == 0 else None, d["t"] if last else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return _grads({**weights, **d})


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    found: dict[str, Any] = {}
    for case in ONE_RANK:
        for reads in READS:
            key = f"one {case} {reads}"
            found[key] = _one_rank(rank % 2, pairs[rank // 2], singles[rank], case, reads)
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for name, m in TWO_RANKS:
        found[f"two {name} {m}"] = _two_ranks(rank, pairs, dps, name, m, give=True)
    found["not given"] = _two_ranks(rank, pairs, dps, "1f1b", 3, give=False)
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_run, 4, timeout=240)


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("case", ONE_RANK, ids=str)
def test_one_rank_replicas_keep_their_datas_gradient(
    results: list[dict[str, Any]], case: tuple[str, int, str], reads: str
) -> None:
    name, m, _ = case
    want = _reference(xp.make(name, 1, m).num_stages, m, reads)
    for rank in range(4):
        got = results[rank][f"one {case} {reads}"]
        assert not isinstance(got, str), (rank, got)
        for when, times in enumerate((1, 2)):  # a second step adds its gradient
            mine = {k: v * times for k, v in want[rank % 2].items()}
            assert_close(got[when], mine, f"{case}, {reads}, rank {rank}, step {when}")


@pytest.mark.parametrize(("name", "m"), TWO_RANKS)
def test_two_rank_replicas_keep_their_datas_gradient(
    results: list[dict[str, Any]], name: str, m: int
) -> None:
    """The batch read by the last stage's loss on rank 1 (given there too): each tensor's
    gradient summed over the replica's two ranks (each rank's copy its stages' part)."""
    want = _reference(xp.make(name, 2, m).num_stages, m, "loss")
    for replica in (0, 1):
        parts = [results[2 * replica + k][f"two {name} {m}"] for k in (0, 1)]
        assert not any(isinstance(p, str) for p in parts), parts
        got = {k: parts[0][k] + parts[1][k] for k in parts[0]}
        assert_close(got, want[replica], f"{name}, m={m}, replica {replica}")


def test_data_that_a_rank_is_not_given_is_refused_by_shape(
    results: list[dict[str, Any]],
) -> None:
    """Rank 1's loss reads its replica's batch, given on rank 0 alone: nothing on rank 1
    tells it from a weight, but its values differ between the replicas; every rank
    refuses it (naming its shape), none averages it."""
    for rank in range(4):
        error = results[rank]["not given"]
        assert isinstance(error, str), (rank, error)
        assert "differ between the data-parallel replicas ((6, 4) torch.float64)" in error, error
        assert "give it to step() on this rank" in error, error


def test_the_walk_tells_the_steps_data_from_a_weight() -> None:
    """``StageLeaves.see`` with the step's data: the batch read whole and a leaf upstream
    of it are data (not found; each read an entry), a temperature is found."""
    from xgrad.torch_backend.pipeline_loss_params import StageLeaves
    from xgrad.torch_backend.pipeline_step_data import StepData

    base = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    x = base * 2.0
    temp = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    chunks = list(x.tensor_split(2))
    data = StepData.of([x], chunks)
    assert data is not None
    loss = (chunks[0] * temp).sum() + x.pow(2).sum() + base.sum()
    stops = StageLeaves.stops(chunks[0])
    found, entries = StageLeaves().see([loss], stops, list, data)
    assert found == [temp]
    assert sorted(type(n).__name__ for n in entries) == ["PowBackward0", "SumBackward0"]
    assert StepData.of([torch.ones(2)], []) is None  # nothing requires grad: no walk of it
