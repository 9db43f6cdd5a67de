"""Tensors a pipeline step differentiates that no stage holds as a parameter.

The targets and a ``loss_kwargs`` tensor that require grad (a learnt target, a learnt
per-feature weight of the loss), and tensors a stage's forward reads without holding them
(a gain kept in a plain list, a module-level ``nn.Parameter`` read by every stage,
another partition's weight, one read on some microbatches only). The runtime saw
neither: where m is not a power of two (each loss's backward undivided, the stages'
gradients divided after) they got m times the unpipelined model's gradient under GPipe
and 1F1B; under the zero-bubble schedules (I and W split) W differentiated the stages'
parameters alone, and they got none (a part of it where a stage ran its whole backward
into an input that requires grad); a target with a graph of its own upstream failed the
second microbatch's backward ("backward through the graph a second time"). torch 2.13's
schedules give them m times the unpipelined model's gradient under B, whatever m (they
divide their stages' parameters alone), and none under their zero-bubble W.

Now the targets and ``loss_kwargs`` divide what reaches them by m, as the step's inputs
do, and W runs the last stage's whole backward into them; a stage's forward is walked
for what it reads of its own, divided with the stage's parameters, differentiated by its
W, and averaged over ``dp_group`` with them. One spawn of two gloo ranks: every gradient,
summed over the two ranks' copies (a tensor read on both, each rank's copy its stages'
part), equals the unpipelined model's (the mean of each microbatch's loss) to 1e-12 in
float64, after one step and, without ``zero_grad``, two.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grads_close import assert_close
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: (schedule, m, checkpoint, W from the joins): one stage a rank (gpipe, 1f1b, zb_h1), two
#: (interleaved_zb: the last on rank 1; zbv, dualpipev: on rank 0 with stage 0, whose
#: weight it reads); m a power of two (each loss divided before its backward) or not.
SCHEDULES = [
    *(
        (name, m, "never", True)
        for name in ("gpipe", "1f1b", "interleaved_zb", "zbv")
        for m in (3, 4)
    ),
    ("dualpipev", 4, "never", True),
    ("1f1b", 3, "always", True),
    ("zbv", 3, "always", True),
    ("zb_h1", 3, "never", False),  # W from the output: what it differentiates, listed
]
#: "data": the batch, the targets and a loss_kwargs tensor require grad; "upstream": the
#: targets are computed from a tensor that does (a graph of their own upstream);
#: "unheld": tensors the stages' forwards read without holding them
KINDS = ("data", "upstream", "unheld")


class Stage(nn.Module):
    """A tanh layer times gains it does not hold: its own, one every stage reads, another
    stage's weight (the last stage), and ``late`` where the first entry of its input is
    negative (stage 1: not on every microbatch)."""

    def __init__(self, lin: nn.Linear, unheld: list[Any]) -> None:
        super().__init__()
        self.lin = lin
        self.unheld = unheld  # a plain list: not registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain, common, tied, late = self.unheld
        h = torch.tanh(self.lin(x)) * gain * common
        if tied is not None:
            h = h + 0.1 * h @ tied
        if late is not None and x[0, 0] < 0:
            h = h * late
        return h


def _model(n: int, kind: str) -> tuple[list[Stage], dict[str, torch.Tensor]]:
    """``n`` stages, and every tensor they train by name (gains of 1 but for "unheld")."""
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4).double() for _ in range(n)]
    named = {f"lin{s}.{k}": p for s, lin in enumerate(lins) for k, p in lin.named_parameters()}
    if kind != "unheld":
        return [Stage(lin, [1.0, 1.0, None, None]) for lin in lins], named
    gains = [  # stage 0 the same whatever n (which microbatches read ``late``)
        nn.Parameter(
            torch.randn(4, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        )
        for s in range(n)
    ]
    common = nn.Parameter(torch.tensor(1.25, dtype=torch.float64))
    late = nn.Parameter(torch.tensor(0.75, dtype=torch.float64))
    stages = [
        Stage(lin, [gains[s], common, lins[0].weight if s == n - 1 else None, None])
        for s, lin in enumerate(lins)
    ]
    stages[1].unheld[3] = late
    named.update({f"gain{s}": g for s, g in enumerate(gains)}, common=common, late=late)
    return stages, named


def _loss(y: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(y * w, t)


def _data(m: int, kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    t = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    w = torch.tensor([0.5, 1.5, -1.0, 2.0], dtype=torch.float64)
    a = torch.tensor(1.5, dtype=torch.float64)
    for leaf in {"data": (x, t, w), "upstream": (a,)}.get(kind, ()):
        leaf.requires_grad_()
    return {"x": x, "t": t, "w": w, "a": a}


def _targets(d: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    return d["t"] * d["a"] if kind == "upstream" else d["t"]


def _grads(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros_like(v) if v.grad is None else v.grad.clone()
        for k, v in tensors.items()
        if v.requires_grad
    }


def _unpipelined(stages: list[Stage], x: torch.Tensor, t: torch.Tensor, w: Any, m: int) -> None:
    """The backward of the mean of the m microbatches' losses, through the whole model."""
    total = torch.zeros((), dtype=torch.float64)
    for xk, tk in zip(x.tensor_split(m), t.tensor_split(m), strict=True):
        for stage in stages:
            xk = stage(xk)
        total = total + _loss(xk, tk, w) / m
    total.backward()


def _reference(n: int, m: int, kind: str) -> dict[str, torch.Tensor]:
    stages, named = _model(n, kind)
    d = _data(m, kind)
    _unpipelined(stages, d["x"], _targets(d, kind), d["w"], m)
    return _grads({**named, **d})


def _pipelined(rank: int, name: str, m: int, checkpoint: str, joins: bool, kind: str) -> Any:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 2, m)
    stages, named = _model(schedule.num_stages, kind)
    mine = schedule.stages_of(rank)
    rt = PipelineRuntime(
        schedule, [stages[s] for s in mine], _loss, timeout=20, checkpoint=checkpoint
    )
    rt.w_from_joins = joins
    d = _data(m, kind)
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    kept = {k: v for k, v in named.items() if not k.startswith("lin") or int(k[3]) in mine}
    kept.update({"x": d["x"]} if first else {})
    kept.update({"t": d["t"], "w": d["w"], "a": d["a"]} if last else {})
    if kind == "unheld" and last and 0 not in mine:
        kept["lin0.weight"] = named["lin0.weight"]  # this rank's copy, read by the last stage
    found = {}
    for when in ("once", "twice"):  # no zero_grad between: twice the gradient
        target = _targets(d, kind) if last else None
        try:
            rt.step(d["x"] if first else None, target, loss_kwargs={"w": d["w"]} if last else None)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        found[when] = _grads(kept)
    return found


def _replica(rank: int, name: str, dp: Any, pipes: list[Any], same: bool) -> dict[str, Any]:
    """This rank as one replica of a one-rank pipeline with ``dp_group`` (its targets its
    own); unless ``same``, replica 1's stage 1 never reads ``late``."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 1, 3)
    stages, named = _model(schedule.num_stages, "unheld")
    if not same and rank == 1:
        stages[1].unheld[3] = None
    rt = PipelineRuntime(schedule, stages, _loss, group=pipes[rank], dp_group=dp, timeout=10)
    d = _data(3, "unheld")
    try:
        rt.step(d["x"], d["t"] + rank, loss_kwargs={"w": d["w"]})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"grads": _grads(named)}


def _replica_reference(name: str) -> dict[str, torch.Tensor]:
    """The unpipelined model's gradients on each replica's batch, averaged."""
    n, sums = xp.make(name, 1, 3).num_stages, []
    for rank in (0, 1):
        stages, named = _model(n, "unheld")
        d = _data(3, "unheld")
        _unpipelined(stages, d["x"], d["t"] + rank, d["w"], 3)
        sums.append(_grads(named))
    return {k: (sums[0][k] + sums[1][k]) / 2 for k in sums[0]}


def _target_of_a_stage(m: int, group: Any) -> dict[str, Any]:
    """The targets computed from a stage's bias, before the step."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    stages, named = _model(2, "plain")
    d = _data(m, "plain")
    rt = PipelineRuntime(xp.make("looped_bfs", 1, m), stages, _loss, group=group, timeout=10)
    try:
        rt.step(d["x"], d["t"] * stages[0].lin.bias, loss_kwargs={"w": d["w"]})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"grads": _grads(named)}


def _bias_read_late() -> tuple[list[Stage], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two stages; stage 0 reads stage 1's bias on microbatch 2 alone (the first entry of
    its input negative there, not on microbatches 0 and 1)."""
    stages, named = _model(2, "unheld")
    stages[1].unheld[3] = None
    stages[0].unheld[3] = stages[1].lin.bias
    d = _data(3, "unheld")
    d["x"][:4, 0] = d["x"][:4, 0].abs()
    assert d["x"][4, 0] < 0
    return stages, named, d


def _read_late(name: str, group: Any) -> dict[str, torch.Tensor] | str:
    """One rank's pipeline of :func:`_bias_read_late`: stage 0 reads stage 1's bias at 0F2,
    after stage 1's backwards of microbatches 0 and 1 added to it (1B1, or 1W1)."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    stages, named, d = _bias_read_late()
    rt = PipelineRuntime(xp.make(name, 1, 3), stages, _loss, group=group, timeout=10)
    try:
        rt.step(d["x"], d["t"], loss_kwargs={"w": d["w"]})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return _grads(named)


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    found: dict[str, Any] = {}
    for name, m, checkpoint, joins in SCHEDULES:
        for kind in KINDS:
            key = f"{name}/{m}/{checkpoint}/{joins}/{kind}"
            found[key] = _pipelined(rank, name, m, checkpoint, joins, kind)
    pipes = [dist.new_group([0]), dist.new_group([1])]
    dp = dist.new_group([0, 1])
    for name in ("interleaved_1f1b", "zbv"):
        found[f"dp {name}"] = _replica(rank, name, dp, pipes, same=True)
    found["dp mismatch"] = _replica(rank, "interleaved_1f1b", dp, pipes, same=False)
    for m in (3, 4):
        found[f"target of a stage {m}"] = _target_of_a_stage(m, pipes[rank])
    for name in ("interleaved_1f1b", "zbv"):
        found[f"bias read late {name}"] = _read_late(name, pipes[rank])
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_run, 2, timeout=150)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "m", "checkpoint", "joins"), SCHEDULES)
def test_what_no_stage_holds_gets_the_unpipelined_gradient(
    results: list[dict[str, Any]], name: str, m: int, checkpoint: str, joins: bool, kind: str
) -> None:
    want = _reference(xp.make(name, 2, m).num_stages, m, kind)
    key = f"{name}/{m}/{checkpoint}/{joins}/{kind}"
    for rank in (0, 1):
        assert "error" not in results[rank][key], results[rank][key]
    for when, times in (("once", 1), ("twice", 2)):
        got: dict[str, torch.Tensor] = {}
        for rank in (0, 1):
            for k, v in results[rank][key][when].items():
                got[k] = got[k] + v if k in got else v
        assert_close(got, {k: v * times for k, v in want.items()}, f"{key}, {when}")


@pytest.mark.parametrize(("n", "m"), [(2, 3), (2, 4), (4, 3), (4, 4)])
def test_late_is_read_by_a_later_microbatch_only(n: int, m: int) -> None:
    """``late`` is found after the step's first backward (set aside and divided then)."""
    x = _data(m, "unheld")["x"]
    stages, _ = _model(n, "unheld")
    with torch.no_grad():
        reads = [stages[0](xk)[0, 0].item() < 0 for xk in x.tensor_split(m)]
    assert not reads[0] and any(reads), reads


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_dp_group_averages_what_the_stages_read_of_their_own(
    results: list[dict[str, Any]], name: str
) -> None:
    want = _replica_reference(name)
    for rank in (0, 1):
        got = results[rank][f"dp {name}"]
        assert "grads" in got, (rank, got)
        assert_close(got["grads"], want, f"dp {name}, replica {rank}")


def test_replicas_whose_stages_read_different_tensors_are_refused(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        error = results[rank]["dp mismatch"].get("error", "")
        assert "data-parallel replicas" in error and "forward of stage 1" in error, error


@pytest.mark.parametrize("m", [3, 4])
def test_targets_computed_from_a_stages_parameter(results: list[dict[str, Any]], m: int) -> None:
    """What reaches the bias through the targets is divided as it reaches them, and again
    with the bias at m = 3: refused, naming the bias and m. At m = 4 each loss is divided
    before its backward: the unpipelined model's gradients."""
    stages, named = _model(2, "plain")
    d = _data(m, "plain")
    _unpipelined(stages, d["x"], d["t"] * stages[0].lin.bias, d["w"], m)
    for rank in (0, 1):
        got = results[rank][f"target of a stage {m}"]
        if m == 3:
            error = got.get("error", "")
            assert "divided twice" in error and "(4,)" in error and "m = 3" in error, got
            continue
        assert "grads" in got, (rank, got)
        assert_close(got["grads"], _grads(named), f"target of a stage, replica {rank}")


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_a_partitions_parameter_an_earlier_stage_reads_late_keeps_what_it_has(
    results: list[dict[str, Any]], name: str
) -> None:
    """Stage 0 first reads stage 1's bias after stage 1's backwards added this step's
    gradient to it: the bias is then due at stage 0's point, later than its own stage's,
    and what it holds is this step's, kept (set aside as an earlier step's, it was added
    back undivided after the division: m times those two microbatches' part)."""
    stages, named, d = _bias_read_late()
    _unpipelined(stages, d["x"], d["t"], d["w"], 3)
    for rank in (0, 1):
        got = results[rank][f"bias read late {name}"]
        assert not isinstance(got, str), got
        assert_close(got, _grads(named), f"{name}, rank {rank}")
