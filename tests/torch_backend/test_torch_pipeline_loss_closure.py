"""A ``loss_fn`` that reads parameters of its own without being a module that holds them.

A lambda closing over a learnt temperature, a ``functools.partial`` or a bound method of a
module with parameters, a loss that reads a stage's weight (tied into the loss): the
runtime saw a loss module's parameters alone, so under B these got m times the
unpipelined model's gradient where m is not a power of two (not divided), and under the
zero-bubble schedules (I and W split) none at all (the last stage's W differentiated its
own parameters and the loss module's). Now the tensors the loss's graph reaches of its
own are found at each forward of the last stage and treated as a loss module's
parameters: divided once with the last stage's, differentiated by its W, and averaged
over ``dp_group`` with its parameters.

One spawn of two gloo ranks. Every parameter's gradient, summed over the two ranks'
copies (the rank that runs a stage holds its gradient, the last stage's rank the loss's,
a weight read by both the sum), equals the unpipelined model's: the mean over the
microbatches of the loss of each, to 1e-12 in float64, after one step and after a second
without ``zero_grad``. Then the two ranks as data-parallel replicas of a one-rank
pipeline: a closure's and a loss module's parameters are averaged over ``dp_group`` as
the stages' are, and replicas whose losses reach different tensors of their own are
refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from grads_close import assert_close
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: the schedules on two ranks: one stage a rank (rank 1 last), and two (interleaved: the
#: last on rank 1 with stage 1; zbv, dualpipev: on rank 0 with stage 0), I and W split in
#: all but gpipe and 1f1b; m a power of two (the loss divided before the backward) or not
#: (the gradients after it).
SCHEDULES = [
    *((name, m) for name in ("gpipe", "1f1b", "interleaved_zb", "zbv") for m in (3, 4)),
    ("dualpipev", 4),
]
KINDS = ("lambda", "partial", "method", "tied", "late")


class Scaled(nn.Module):
    """A module whose bound method is the loss (its parameter read, its forward unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([0.5, 1.5, -1.0, 2.0], dtype=torch.float64))

    def loss(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y * self.s, t)


class TemperedLoss(nn.Module):
    """A loss module with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y * self.t, t)


def _head_loss(head: nn.Module, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(head(y), t)


def _model(n: int) -> tuple[list[nn.Module], dict[str, Any]]:
    """``n`` stages and every parameter a loss below reads of its own."""
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(n)]
    extra = {
        "temp": nn.Parameter(torch.tensor(1.5, dtype=torch.float64)),
        "late": nn.Parameter(torch.tensor(0.25, dtype=torch.float64)),
        "head": nn.Linear(4, 4).double(),
        "scaled": Scaled(),
        "module": TemperedLoss(),
    }
    return parts, extra


def _loss(kind: str, parts: list[nn.Module], extra: dict[str, Any]) -> Loss:
    temp, late = extra["temp"], extra["late"]
    if kind == "lambda":
        return lambda y, t: nn.functional.mse_loss(y * temp, t)
    if kind == "partial":
        return functools.partial(_head_loss, extra["head"])
    if kind == "method":
        return extra["scaled"].loss  # type: ignore[no-any-return]
    if kind == "module":
        return extra["module"]  # type: ignore[no-any-return]
    first, last = parts[0][0].weight, parts[-1][0].weight
    if kind == "tied":  # stage 0's weight (zbv: on the last stage's rank) and the last's
        return lambda y, t: (
            nn.functional.mse_loss(y, t)
            + 0.1 * (y @ first).pow(2).mean()
            + 0.01 * last.pow(2).sum()
        )

    def data_dependent(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # ``late`` only where the target's first entry is positive: not microbatch 0
        loss = nn.functional.mse_loss(y * temp, t)
        return loss + late * y.mean() if t[0, 0] > 0 else loss

    return data_dependent


def _batch(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    y = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    y[::2, 0] = torch.tensor([-1.0 if k % 2 == 0 else 1.0 for k in range(m)], dtype=y.dtype)
    return x, y


def _named(parts: list[nn.Module], extra: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    named = [
        (f"stage {s}.{k}", p) for s, part in enumerate(parts) for k, p in part.named_parameters()
    ]
    for key, value in extra.items():
        params = [("", value)] if isinstance(value, torch.Tensor) else value.named_parameters()
        named += [(f"{key}.{k}".rstrip("."), p) for k, p in params]
    return named


def _grads(parts: list[nn.Module], extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in _named(parts, extra)
    }


def _reference(n: int, m: int, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """The unpipelined model's gradients: the mean over microbatches of each one's loss."""
    parts, extra = _model(n)
    loss_fn = _loss(kind, parts, extra)
    x, y = _batch(m, seed)
    total = None
    for xk, yk in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        out = xk
        for part in parts:
            out = part(out)
        loss = loss_fn(out, yk) / m
        total = loss if total is None else total + loss
    assert total is not None
    total.backward()
    return _grads(parts, extra)


def _pipelined(rank: int, name: str, m: int) -> dict[str, Any]:
    """Each loss in turn on one runtime (a step finds the loss's tensors anew: ``loss_fn``
    may change between steps), two steps each, the gradients zeroed in between."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 2, m)
    parts, extra = _model(schedule.num_stages)
    mine = schedule.stages_of(rank)
    loss_fn = _loss("lambda", parts, extra)
    rt = PipelineRuntime(schedule, [parts[s] for s in mine], loss_fn, timeout=20)
    x, y = _batch(m, seed=1)
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    found = {}
    for kind in KINDS:
        rt.loss_fn = _loss(kind, parts, extra)
        rt.step(x if first else None, y if last else None)
        once = _grads(parts, extra)
        rt.step(x if first else None, y if last else None)  # no zero_grad: twice the gradient
        found[kind] = {"once": once, "twice": _grads(parts, extra)}
        for _, p in _named(parts, extra):
            p.grad = None
    return found


def _replica(rank: int, name: str, kind: str, pipes: list[Any], dp: Any) -> dict[str, Any]:
    """This rank as one replica of a one-rank pipeline, averaged over ``dp``."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, 1, 3)
    parts, extra = _model(schedule.num_stages)
    loss_fn = _loss(kind, parts, extra)
    rt = PipelineRuntime(schedule, parts, loss_fn, group=pipes[rank], dp_group=dp, timeout=10)
    x, y = _batch(3, seed=1 + rank)
    if kind == "late" and rank == 1:
        y[:, 0] = -1.0  # replica 1's loss never reads ``late``: refused on both
    try:
        rt.step(x, y)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"grads": _grads(parts, extra)}


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    found: dict[str, Any] = {}
    for name, m in SCHEDULES:
        for kind, grads in _pipelined(rank, name, m).items():
            found[f"{name}/{m}/{kind}"] = grads
    pipes = [dist.new_group([0]), dist.new_group([1])]
    dp = dist.new_group([0, 1])
    for name in ("1f1b", "zbv"):
        for kind in ("lambda", "module", "tied"):
            found[f"dp {name}/{kind}"] = _replica(rank, name, kind, pipes, dp)
    found["dp mismatch"] = _replica(rank, "1f1b", "late", pipes, dp)
    for hidden in (False, True):
        found[f"dp heads {hidden}"] = _heads_replica(rank, hidden, pipes, dp)
    for m in (3, 4):
        found[f"tied input {m}"] = _tied_input(m, pipes[rank])
    return found


def _tied_embedding(m: int) -> tuple[nn.Embedding, nn.Module, torch.Tensor, torch.Tensor, Loss]:
    """The step's input embedded before the step, the loss's projection tied to it."""
    torch.manual_seed(0)
    emb, part = nn.Embedding(5, 4).double(), nn.Linear(4, 4).double()
    tokens, targets = torch.arange(2 * m) % 5, (torch.arange(2 * m) + 1) % 5
    return emb, part, tokens, targets, lambda h, t: nn.functional.cross_entropy(h @ emb.weight.T, t)


def _tied_input(m: int, group: Any) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    emb, part, tokens, targets, loss = _tied_embedding(m)
    rt = PipelineRuntime(xp.make("gpipe", 1, m), [part], loss, group=group, timeout=10)
    try:
        rt.step(emb(tokens), targets)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"grads": [emb.weight.grad, *(p.grad for p in part.parameters())]}


class _Slots:
    """Holds tensors where the loss function's walk does not look (no ``__dict__``)."""

    __slots__ = ("heads",)

    def __init__(self, heads: list[torch.Tensor]) -> None:
        self.heads = heads


def _heads(hidden: bool) -> tuple[nn.Module, list[nn.Parameter], Loss]:
    """A multitask loss: a head of the same shape picked by the target's first entry."""
    torch.manual_seed(0)
    part = nn.Linear(4, 4).double()
    heads = [nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(2)]
    box = _Slots(heads)

    def loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y * heads[0 if t[0, 0] > 0 else 1], t)

    def unseen(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y * box.heads[0 if t[0, 0] > 0 else 1], t)

    return part, heads, unseen if hidden else loss


def _heads_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica 0's microbatch 0 takes head 0 and its microbatch 1 head 1; replica 1's the
    reverse: both losses reach both heads, in another order."""
    x, y = _batch(2, seed=5 + rank)
    y[0, 0], y[2, 0] = (1.0, -1.0) if rank == 0 else (-1.0, 1.0)
    return x, y


def _heads_replica(rank: int, hidden: bool, pipes: list[Any], dp: Any) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part, heads, loss = _heads(hidden)
    rt = PipelineRuntime(xp.make("gpipe", 1, 2), [part], loss, group=pipes[rank], dp_group=dp)
    x, y = _heads_batch(rank)
    try:
        rt.step(x, y)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"grads": [p.grad for p in (*part.parameters(), *heads)]}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_run, 2, timeout=120)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "m"), SCHEDULES)
def test_a_loss_closures_parameters_get_the_unpipelined_gradient(
    results: list[dict[str, Any]], name: str, m: int, kind: str
) -> None:
    want = _reference(xp.make(name, 2, m).num_stages, m, kind, seed=1)
    ranks = [results[rank][f"{name}/{m}/{kind}"] for rank in (0, 1)]
    for when, times in (("once", 1), ("twice", 2)):
        got = {k: ranks[0][when][k] + ranks[1][when][k] for k in want}
        assert_close(
            got,
            {k: v * times for k, v in want.items()},
            f"{name}, m={m}, {kind}, {when}",
            same_keys=False,
        )


@pytest.mark.parametrize("kind", ["lambda", "module", "tied"])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_dp_group_averages_the_loss_parameters(
    results: list[dict[str, Any]], name: str, kind: str
) -> None:
    n = xp.make(name, 1, 3).num_stages
    sums = [_reference(n, 3, kind, seed=1 + rank) for rank in (0, 1)]
    want = {k: (sums[0][k] + sums[1][k]) / 2 for k in sums[0]}
    for rank in (0, 1):
        assert_close(
            results[rank][f"dp {name}/{kind}"]["grads"],
            want,
            f"dp {name} {kind} {rank}",
            same_keys=False,
        )


def test_replicas_whose_losses_reach_different_tensors_are_refused(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        error = results[rank]["dp mismatch"].get("error", "")
        assert "data-parallel replicas" in error and "loss" in error, (rank, error)


def test_what_a_later_microbatch_finds_is_set_aside_and_divided_at_the_losss_point() -> None:
    """``StepScaling.more`` after the step's first backward (no process group; GPipe, one
    stage, m = 3, the loss's point after B2): a new tensor's ``.grad`` is set aside and
    added back after its division there, and a partition's parameter the loss reads
    (divided after B0 here) moves to the loss's point, so the loss's part is divided too."""
    from xgrad.torch_backend.pipeline_scale import StepScaling

    actions = xp.make("gpipe", 1, 3).actions[0]  # F0 F1 F2 B0 B1 B2
    lin = nn.Linear(2, 2).double()
    temp = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    temp.grad = torch.tensor(1.0, dtype=torch.float64)  # an earlier step's
    scaling = StepScaling(3, actions, {0: 3}, [lin], extra=(5, []))
    scaling.begin(None)
    scaling.more([temp, lin.weight], 5)
    assert temp.grad is not None and temp.grad.item() == 0.0  # set aside
    lin.weight.grad = torch.full_like(lin.weight, 3.0)
    assert lin.bias.grad is None
    lin.bias.grad = torch.full_like(lin.bias, 3.0)
    for action in actions[3:5]:
        scaling.after(action)
    assert torch.equal(lin.bias.grad, torch.full_like(lin.bias, 1.0))  # its own point
    assert torch.equal(lin.weight.grad, torch.full_like(lin.weight, 3.0))  # moved
    temp.grad += 6.0
    scaling.after(actions[5])
    assert torch.equal(lin.weight.grad, torch.full_like(lin.weight, 1.0))
    assert temp.grad.item() == 3.0  # 6 / 3, and the 1 set aside added back


def test_replicas_that_reach_the_losss_tensors_in_another_order_average_each_with_itself(
    results: list[dict[str, Any]],
) -> None:
    """Replica 0's loss reaches head 0 then head 1, replica 1's head 1 then head 0: each
    head is averaged with itself (they were paired in the order found: head 0's gradient
    averaged with head 1's, the replicas then apart)."""
    sums = []
    for rank in (0, 1):
        part, heads, loss = _heads(hidden=False)
        x, y = _heads_batch(rank)
        pairs = zip(x.tensor_split(2), y.tensor_split(2), strict=True)
        sum(loss(part(xk), yk) / 2 for xk, yk in pairs).backward()  # type: ignore[union-attr]
        sums.append([p.grad for p in (*part.parameters(), *heads)])
    want = [(a + b) / 2 for a, b in zip(*sums, strict=True)]
    for rank in (0, 1):
        got = results[rank]["dp heads False"]
        assert "grads" in got, (rank, got)
        for k, (g, w) in enumerate(zip(got["grads"], want, strict=True)):
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (rank, k, g, w)


def test_tensors_the_loss_reaches_but_does_not_hold_alike_are_refused(
    results: list[dict[str, Any]],
) -> None:
    """Heads the walk of the loss function cannot see (held where it does not look), of
    one shape: no replica can tell which is which, so every replica refuses them."""
    for rank in (0, 1):
        error = results[rank]["dp heads True"].get("error", "")
        assert "cannot tell which is which" in error, (rank, error)


def test_the_order_is_where_the_loss_function_holds_its_tensors() -> None:
    """``in_order``: a closure's cells, a partial's arguments, a bound module, a global,
    whatever order they were found in; one the walk cannot see comes last."""
    from xgrad.torch_backend.pipeline_loss_order import in_order

    a, b, c = (torch.zeros(2, requires_grad=True) for _ in range(3))
    hidden = torch.zeros(3, requires_grad=True)
    scaled = Scaled()

    def fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (y * a * b).sum() + (c * t).sum()

    ordered, keys, alike = in_order([hidden, c, b, a], fn)
    assert ordered == [a, b, c, hidden] and not alike
    assert [k[0] for k in keys] == [0, 1, 2, -1]
    part = functools.partial(_head_loss, scaled)
    assert in_order([b, scaled.s], part)[0] == [scaled.s, b]
    assert in_order([scaled.s, b], scaled.loss)[0] == [scaled.s, b]
    assert in_order([hidden, torch.ones(3, requires_grad=True)], fn)[2]  # alike, unseen


@pytest.mark.parametrize("m", [3, 4])
def test_a_loss_tied_to_what_the_step_input_was_computed_from(
    results: list[dict[str, Any]], m: int
) -> None:
    """The input embedded before the step (it requires grad), the loss's projection tied to
    the embedding: what reaches the embedding through the input was divided by m as it
    reached the input, and again with the loss's tensors (two thirds short at m = 3), and
    m = 3 was refused. The embedding is what the step's input was computed from: the
    step's data (``pipeline_step_data``), what the loss reads of it divided as it reads
    it, so at m = 3 too the gradients are the unpipelined model's (at m = 4 each
    microbatch's loss is divided before its backward)."""
    emb, part, tokens, targets, loss = _tied_embedding(m)
    x = emb(tokens)
    pairs = zip(x.tensor_split(m), targets.tensor_split(m), strict=True)
    sum(loss(part(xk), tk) / m for xk, tk in pairs).backward()  # type: ignore[union-attr]
    want = [emb.weight.grad, *(p.grad for p in part.parameters())]
    for rank in (0, 1):
        got = results[rank][f"tied input {m}"]
        assert "grads" in got, (rank, got)
        for g, w in zip(got["grads"], want, strict=True):
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (rank, g, w)
