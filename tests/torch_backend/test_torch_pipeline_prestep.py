"""Tensors computed before a pipeline step, with a graph of their own, that every
microbatch reads (``pipeline_shared_graph``).

A stage's forward reads ``w2 = w * 2`` of a module-level ``nn.Parameter`` and
``tied = lin0.weight.tanh()`` of another module's weight, or the loss closes over
``xt = x.tanh()`` of the batch, which requires grad: each computed once before ``step()``.
Every microbatch's graph shares their nodes; the first microbatch's backward freed them,
and the second raised "Trying to backward through the graph a second time" (as torch's
pipelining does), but where the whole stage graph was walked and the runtime kept the
graph: now under every schedule and m, with and without ``dp_group``, the leaves get the
unpipelined model's gradients (one backward through the shared graph), to 1e-12 in
float64; the microbatches' own graphs are still freed after their backward; and a stage
that reads one first on a later microbatch (not seen where the stage's graph is walked
once a step) raises an error that names the stage, the microbatch and the way out.

One spawn of two gloo ranks: a two-rank pipeline, then two replicas of one-rank pipelines.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from grads_close import assert_close
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

NAMES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zb",
    "zbv",
    "dualpipev",
    "zb_h1",
    "zb_h2",
)
#: (schedule, m, checkpoint) of a two-rank pipeline: m a power of two (the stage's graph
#: walked once a step) or not (every forward walked)
CASES = [
    *((name, m, "never") for name in NAMES for m in ((5, 4) if name == "dualpipev" else (3, 4))),
    ("1f1b", 4, "always"),
    ("zbv", 3, "always"),
]
#: one-rank pipelines as two data-parallel replicas: (schedule, m)
REPLICAS = [(name, m) for name in ("gpipe", "1f1b", "interleaved_1f1b", "zbv") for m in (3, 4)]
#: "stage": the first and last stages read w2 and tied; "loss": the loss reads x.tanh()
READS = ("stage", "loss")


class Stage(nn.Module):
    """A tanh layer, times what ``read`` holds (a plain list: not registered); from its
    ``after``-th call on alone."""

    def __init__(self, lin: nn.Linear, read: list[torch.Tensor], after: int = 0) -> None:
        super().__init__()
        self.lin = lin
        self.read = read
        self.after = after
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        self.calls += 1
        if self.calls > self.after:
            for r in self.read:
                h = h * r if r.dim() < 2 else h + 0.1 * h @ r
        return h


class _Box:
    """Held by a graph node alone: a weak reference to it tells when the node goes."""

    __slots__ = ("__weakref__",)


class _Held(torch.autograd.Function):
    """The identity, whose node holds a :class:`_Box` (and the node its microbatch's
    saved tensors: they go with it)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, box: _Box) -> torch.Tensor:
        ctx.box = box
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Tracked(Stage):
    """A :class:`Stage` whose graph holds a box: ``live`` holds, at each forward's start,
    how many of the earlier forwards' graphs are still held."""

    def __init__(self, lin: nn.Linear, read: list[torch.Tensor]) -> None:
        super().__init__(lin, read)
        self.boxes: list[weakref.ref[_Box]] = []
        self.live: list[int] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.live.append(self.held())
        box = _Box()
        self.boxes.append(weakref.ref(box))
        return _Held.apply(super().forward(h), box)

    def held(self) -> int:
        return sum(ref() is not None for ref in self.boxes)


def _model(n: int, m: int, reads: str, seed: int = 1, stage: type[Stage] = Stage) -> Any:
    """``n`` stages, the data (the batch and targets of ``seed``), the leaves by name, the
    loss, and the shared tensors computed before the step."""
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4).double() for _ in range(n)]
    w = nn.Parameter(torch.tensor([0.5, 1.5, -1.0, 2.0], dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64, requires_grad=reads == "loss")
    t = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    reads_of: list[list[torch.Tensor]] = [[] for _ in range(n)]
    xt = None
    if reads == "stage":
        w2, tied = w * 2, lins[0].weight.tanh()  # before the step: shared graphs
        reads_of[0].append(w2)
        reads_of[-1] += [w2, tied]
    else:
        xt = x.tanh()
    stages = [stage(lin, r) for lin, r in zip(lins, reads_of, strict=True)]

    def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = nn.functional.mse_loss(y, target)
        return out if xt is None else out + 0.1 * (y.mean() * xt).pow(2).mean()

    named = {f"lin{s}.{k}": p for s, lin in enumerate(lins) for k, p in lin.named_parameters()}
    named.update(w=w, x=x)
    return stages, x, t, named, loss


def _grads(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros_like(v) if v.grad is None else v.grad.clone()
        for k, v in named.items()
        if v.requires_grad
    }


def _reference(n: int, m: int, reads: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """The unpipelined model: one backward of the mean of the microbatches' losses."""
    stages, x, t, named, loss = _model(n, m, reads, seed)
    total = torch.zeros((), dtype=torch.float64)
    for xk, tk in zip(x.tensor_split(m), t.tensor_split(m), strict=True):
        for stage in stages:
            xk = stage(xk)
        total = total + loss(xk, tk) / m
    total.backward()
    return _grads(named)


def _pipelined(rank: int, case: tuple[str, int, str], reads: str) -> Any:
    """This rank of a two-rank pipeline: its copies' gradients, or the error."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    name, m, checkpoint = case
    schedule = xp.make(name, 2, m)
    stages, x, t, named, loss = _model(schedule.num_stages, m, reads)
    mine = schedule.stages_of(rank)
    rt = PipelineRuntime(
        schedule, [stages[s] for s in mine], loss, timeout=20, checkpoint=checkpoint
    )
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    try:
        rt.step(x if first else None, t if last else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return _grads(named)


def _replica(rank: int, name: str, m: int, reads: str, pipe: Any, dp: Any) -> Any:
    """This rank as a replica of a one-rank pipeline, on its own batch."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 1, m)
    stages, x, t, named, loss = _model(schedule.num_stages, m, reads, seed=1 + rank)
    rt = PipelineRuntime(schedule, stages, loss, group=pipe, dp_group=dp, timeout=20)
    try:
        rt.step(x, t)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return _grads(named)


def _freed(rank: int) -> Any:
    """1F1B, m = 4, the stages reading w2 and tied: how many microbatches' graphs each
    forward finds still held (rank 0: F0 F1 B0 F2 B1 F3 B2 B3), and after the step."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make("1f1b", 2, 4)
    stages, x, t, _, loss = _model(2, 4, "stage", stage=Tracked)
    rt = PipelineRuntime(schedule, [stages[rank]], loss, timeout=20, checkpoint="never")
    try:
        rt.step(x if rank == 0 else None, t if rank == 1 else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    part = stages[rank]
    assert isinstance(part, Tracked)
    return part.live, part.held(), len(part.boxes)


def _read_late(rank: int) -> str:
    """GPipe, m = 4 (the stage's graph walked at its first forward alone): stage 0 reads
    w2 from its second microbatch on."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    stages, x, t, _, loss = _model(2, 4, "stage")
    stages[0].after = 1
    schedule = xp.make("gpipe", 2, 4)
    rt = PipelineRuntime(schedule, [stages[rank]], loss, timeout=20, checkpoint="never")
    try:
        rt.step(x if rank == 0 else None, t if rank == 1 else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    found: dict[str, Any] = {}
    for case in CASES:
        for reads in READS:
            found[f"{case} {reads}"] = _pipelined(rank, case, reads)
    found["freed"] = _freed(rank)
    found["late"] = _read_late(rank)
    pipes = [dist.new_group([0]), dist.new_group([1])]
    dp = dist.new_group([0, 1])
    for name, m in REPLICAS:
        for reads in READS:
            found[f"dp {name} {m} {reads}"] = _replica(rank, name, m, reads, pipes[rank], dp)
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_run, 2, timeout=240)


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_graph_computed_before_the_step_gets_the_unpipelined_gradient(
    results: list[dict[str, Any]], case: tuple[str, int, str], reads: str
) -> None:
    """Each tensor's gradient summed over the two ranks' copies (each its stages' part)."""
    name, m, _ = case
    parts = [results[rank][f"{case} {reads}"] for rank in (0, 1)]
    assert not any(isinstance(p, str) for p in parts), parts
    got = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    assert_close(got, _reference(xp.make(name, 2, m).num_stages, m, reads), f"{case}, {reads}")


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize(("name", "m"), REPLICAS)
def test_under_dp_group_too(results: list[dict[str, Any]], name: str, m: int, reads: str) -> None:
    """The weights' gradients averaged over the replicas, the batch's its replica's."""
    n = xp.make(name, 1, m).num_stages
    want = [_reference(n, m, reads, seed=1 + rank) for rank in (0, 1)]
    for rank in (0, 1):
        got = results[rank][f"dp {name} {m} {reads}"]
        assert not isinstance(got, str), (rank, got)
        mine = {k: (want[0][k] + want[1][k]) / 2 for k in want[0]}
        if "x" in mine:
            mine["x"] = want[rank]["x"]
        assert_close(got, mine, f"dp {name}, m={m}, {reads}, replica {rank}")


def test_each_microbatchs_graph_is_freed_after_its_backward(
    results: list[dict[str, Any]],
) -> None:
    """The backwards keep the graph (for its shared part), yet a microbatch's graph, with
    its saved tensors, goes once its backward ran: each forward after B0 finds one
    microbatch's held, and none is after the step."""
    for rank in (0, 1):
        assert not isinstance(results[rank]["freed"], str), results[rank]["freed"]
        live, held, made = results[rank]["freed"]
        assert made == 4, (rank, made)
        want = [0, 1, 1, 1] if rank == 0 else [0, 0, 0, 0]  # rank 1: F0 B0 F1 B1 ...
        assert live == want, (rank, live, want)
        assert held == 0, (rank, held)


def test_a_graph_first_read_by_a_later_microbatch_is_named(
    results: list[dict[str, Any]],
) -> None:
    """Not seen at the stage's first forward: its second backward through the shared
    graph raises, naming the stage, the microbatch, the cause and the way out."""
    for rank in (0, 1):
        error = results[rank]["late"]
        assert "stage 0's backward of microbatch 2" in error, (rank, error)
        assert "a tensor computed before the step" in error, error
        assert "Compute it inside the stage's forward (or the loss)" in error, error


def test_the_walks_tell_nodes_made_before_the_forward() -> None:
    """``reaches_older`` and ``walk``: ``w * 2`` taken before the forward is older, and so
    is a node numbered after it (another thread's, whose counter is ahead); the forward's
    own nodes, leaves and the arguments' nodes (stops) are not."""
    from xgrad.torch_backend.pipeline_shared_graph import forward_mark, reaches_older, walk

    w = torch.ones(3, requires_grad=True)
    w2 = w * 2
    x = (torch.ones(3, requires_grad=True) * 3).tanh()  # an argument with a graph
    mark = forward_mark()
    plain = (x * w).sum()
    shared = (x * w2).sum()
    made = (mark, forward_mark())
    stops = {x.grad_fn}
    assert not reaches_older([plain.grad_fn], stops, made)
    assert reaches_older([shared.grad_fn], stops, made)
    assert reaches_older([plain.grad_fn], set(), made)  # x's own graph, made before
    assert reaches_older([(w * 4).grad_fn], set(), made)  # numbered after the forward's
    leaves, entries, older = walk([shared.grad_fn], stops, made, None)
    assert older and not entries and [id(t) for t in leaves] == [id(w)]
    assert walk([plain.grad_fn], stops, made, None)[2] is False
