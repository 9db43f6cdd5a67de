"""Logged arrivals: gradients equal PyTorch's DDP bit for bit whatever order they come in.

The layout (which hooks only log) is checked in this process; the DDP scenarios run in
one spawned gloo group of 3 ranks (an odd world size: the pre-division by 3 is not
exact), each step compared with PyTorch's DDP on the same model and data.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from xgrad.buckets import BucketPlan
from xgrad.torch_backend.ddp_arrivals import LOGGED_NUMEL, ArrivalLog
from xgrad.torch_backend.spawn import spawn

# ----------------------------------------------------------------- in process


def _plan(*buckets: tuple[int, ...]) -> BucketPlan:
    return BucketPlan(buckets=buckets, limits=(1 << 20,) * len(buckets))


def _log(sizes: list[int]) -> tuple[ArrivalLog, list[nn.Parameter], list[list[str]]]:
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    calls: list[list[str]] = [[] for _ in params]

    def python(i: int) -> Any:
        return lambda p: calls[i].append("python")

    hooks = [python(i) for i in range(len(params))]
    handles = [p.register_post_accumulate_grad_hook(h) for p, h in zip(params, hooks, strict=True)]
    return ArrivalLog(params, handles, hooks), params, calls


def test_first_and_each_buckets_last_keep_python_hooks() -> None:
    log, params, calls = _log([4, 4, 4, 4, LOGGED_NUMEL, 4])
    plan = _plan((0, 1, 2), (3, 4, 5))
    log.relayout((5, 4, 3, 2, 1, 0), (), plan)
    # 5 arrives first; 0 is last of (0, 1, 2), 3 last of (3, 4, 5); 4 is large.
    assert log.logged == [False, True, True, False, False, False]
    sum(p.sum() for p in params).backward()
    assert [len(c) for c in calls] == [1, 0, 0, 1, 1, 1]
    assert sorted(map(id, log.log)) == sorted(map(id, params[1:3]))
    indices, grads = log.take()
    assert sorted(indices) == [1, 2] and all(g is not None for g in grads)
    assert log.log == []


def test_a_parameter_that_would_be_logged_alone_keeps_its_python_hook() -> None:
    log, _, _ = _log([4, 4, LOGGED_NUMEL, 4, 4, 4])
    log.relayout((0, 1, 2, 3, 4, 5), (), _plan((0, 1, 2, 3, 4, 5)))
    # 0 first, 2 large, 5 last: 1 sits alone between Python hooks, 3 and 4 are a run.
    assert log.logged == [False, False, False, True, True, False]


def test_unused_parameters_are_not_taken_for_the_first_or_last() -> None:
    log, _, _ = _log([4, 4, 4])
    log.relayout((2, 1, 0), (2,), _plan((0, 1, 2)))
    assert log.logged == [False, False, True]  # 1 arrived first, 0 last; 2 was unused


def test_a_parameter_with_another_hook_is_never_logged() -> None:
    params = [nn.Parameter(torch.zeros(4)) for _ in range(3)]
    params[1].register_post_accumulate_grad_hook(lambda p: None)  # before DDP's
    hooks = [lambda p: None for _ in params]
    handles = [p.register_post_accumulate_grad_hook(h) for p, h in zip(params, hooks, strict=True)]
    log = ArrivalLog(params, handles, hooks)
    log.relayout((2, 1, 0), (), _plan((0, 1, 2)))
    assert log.logged == [False, False, False]  # 1 has another hook; 2 first, 0 last
    log2, ps, _ = _log([4, 4, 4, 4])
    log2.relayout((0, 1, 2, 3), (), _plan((0, 1, 2, 3)))
    assert log2.logged == [False, True, True, False]
    assert log2.hooks_unchanged()
    ps[1].register_post_accumulate_grad_hook(lambda p: None)
    assert not log2.hooks_unchanged()
    log2.disable()
    assert log2.logged == [False] * 4 and not log2.enabled


def test_ddps_hook_runs_after_a_hook_added_later() -> None:
    log, params, calls = _log([4, 4])
    params[0].register_post_accumulate_grad_hook(lambda p: calls[0].append("user"))
    params[1].register_post_accumulate_grad_hook(lambda p: calls[1].append("user"))
    assert not log.hooks_last(running=0)  # parameter 0's hooks are running: left alone
    assert log.hooks_last()  # the next call moves it
    assert log.hooks_last()  # and then looks at nothing until a hook is made
    (params[0].sum() + params[1].sum()).backward()
    assert calls == [["user", "python"], ["user", "python"]]  # where PyTorch's reducer reads


# ----------------------------------------------------------------- in a gloo group


class _Chain(nn.Module):
    """Small residual blocks (one large one): the order they run in can be reversed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(9))
        self.big = nn.Linear(8, 8 * 1024 // 4)  # LOGGED_NUMEL-sized weight: a Python hook
        self.head = nn.Linear(8 * 1024 // 4, 8)
        self.reverse = False
        self.skip: set[int] = set()
        self.reentrant = False
        self.reuse: int | None = None  # a block run again, in a checkpoint of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = list(enumerate(self.blocks))
        for i, block in reversed(blocks) if self.reverse else blocks:
            if i in self.skip:
                continue
            if self.reentrant:
                x = x + checkpoint(block, x, use_reentrant=True)
            else:
                x = x + 0.5 * torch.tanh(block(x))
        if self.reuse is not None:
            x = x + checkpoint(self.blocks[self.reuse], x, use_reentrant=True)
        return self.head(torch.tanh(self.big(x)))  # type: ignore[no-any-return]


def _halve_in_place(param: torch.Tensor) -> None:
    param.grad.mul_(0.5)  # type: ignore[union-attr]


def _replace_halved(param: torch.Tensor) -> None:
    param.grad = param.grad * 0.5  # type: ignore[operator]


#: per step: what the step does differently.
_STEPS = (
    *("plain", "plain", "plain", "reverse", "reverse", "plain", "no_sync", "plain"),
    *("skip", "plain", "foreign", "plain"),
)


def _scenario(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, Any] = {"mismatches": [], "logged": []}
    torch.manual_seed(0)
    base = _Chain()
    kwargs = {"bucket_cap_mb": 1e-3, "find_unused_parameters": True}
    ours = DistributedDataParallel(copy.deepcopy(base), **kwargs)  # type: ignore[arg-type]
    theirs = TorchDDP(copy.deepcopy(base), **kwargs)  # type: ignore[arg-type]
    counted: list[int] = []
    for step, how in enumerate(_STEPS):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(3, 8)
        for ddp in (ours, theirs):
            ddp.module.reverse = how == "reverse"
            ddp.module.skip = {2, 3} if how == "skip" else set()
            if how == "foreign":  # a hook of the user's on a (so far logged) parameter
                ddp.module.blocks[4].bias.register_post_accumulate_grad_hook(
                    lambda p: counted.append(1)
                )
            ddp.zero_grad(set_to_none=True)
            if how == "no_sync":
                with ddp.no_sync():
                    ddp(x).square().sum().backward()
            ddp(x).square().sum().backward()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            same = (p.grad is None and q.grad is None) or (
                p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
            )
            if not same:
                out["mismatches"].append(f"step {step} ({how}): {n}")
        out["logged"].append(sum(ours._grad_hooks.arrivals.logged))
        with torch.no_grad():
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                if p.grad is not None:
                    p -= 0.01 * p.grad
                    q -= 0.01 * q.grad  # type: ignore[operator]
    out["foreign_calls"] = len(counted)

    # Reentrant checkpointing (static graph, one block unused in every iteration, one
    # run twice, so its hooks run twice per iteration): hooks run in nested graph tasks,
    # so every hook stays a Python one. Gradients equal PyTorch's with the hooks that
    # log and with Python hooks from the start, also at the second step (still the
    # initial bucket: a static graph rebuilds from the second iteration's order, unused
    # parameters last) and after the rebuild.
    torch.manual_seed(1)
    base = _Chain()
    base.reentrant = True
    base.skip = {2}
    base.reuse = 4
    static = {"static_graph": True, "bucket_cap_mb": 1e-3}
    ours = DistributedDataParallel(copy.deepcopy(base), **static)  # type: ignore[arg-type]
    python = DistributedDataParallel(copy.deepcopy(base), **static)  # type: ignore[arg-type]
    python._grad_hooks.arrivals.disable()
    theirs = TorchDDP(copy.deepcopy(base), **static)  # type: ignore[arg-type]
    for step in range(4):
        torch.manual_seed(7 * step + rank)
        x = torch.randn(3, 8, requires_grad=True)
        for ddp in (ours, python, theirs):
            ddp.zero_grad(set_to_none=True)
            ddp(x).square().sum().backward()
        for (n, p), q, r in zip(
            ours.named_parameters(), python.parameters(), theirs.parameters(), strict=True
        ):
            for label, mine in (("logged", p), ("python", q)):
                same = (mine.grad is None and r.grad is None) or (
                    mine.grad is not None and r.grad is not None and torch.equal(mine.grad, r.grad)
                )
                if not same:
                    out["mismatches"].append(f"reentrant step {step} ({label}): {n}")
    rebuilt = str(theirs._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", ""))
    out["reentrant_plans"] = (
        ours.plan.buckets,
        tuple(tuple(int(i) for i in bucket.split()) for bucket in rebuilt.split(",")),
    )
    out["reentrant_logged"] = sum(ours._grad_hooks.arrivals.logged)
    out["reentrant_enabled"] = ours._grad_hooks.arrivals.enabled

    # Hooks of the user's registered on the wrapped model run before the reduction, as
    # with PyTorch's DDP (its reducer reads a gradient after every post-accumulate-grad
    # hook): from the second step one halves a large gradient in place, one replaces a
    # small (so far logged) one; at the third a hook registered between the forward and
    # the backward halves the first layer's weight.
    torch.manual_seed(3)
    base = _Chain()
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-3)
    for step in range(4):
        torch.manual_seed(11 * step + rank)
        x = torch.randn(3, 8)
        for ddp in (ours, theirs):
            if step == 1:
                ddp.module.big.weight.register_post_accumulate_grad_hook(_halve_in_place)
                ddp.module.blocks[4].weight.register_post_accumulate_grad_hook(_replace_halved)
            ddp.zero_grad(set_to_none=True)
            y = ddp(x)
            if step == 2:
                ddp.module.blocks[0].weight.register_post_accumulate_grad_hook(_halve_in_place)
            y.square().sum().backward()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            if not torch.equal(p.grad, q.grad):  # type: ignore[arg-type]
                out["mismatches"].append(f"user's hook, step {step}: {n}")

    # A backward pass that reaches logged parameters only (not through the output):
    # the next forward pass reports the reduction it left unfinished.
    torch.manual_seed(2)
    ddp = DistributedDataParallel(_Chain(), bucket_cap_mb=1e-3)
    x = torch.randn(3, 8)
    for _ in range(3):
        ddp(x).sum().backward()
    logged = [p for p, on in zip(ddp._params, ddp._grad_hooks.arrivals.logged, strict=True) if on]
    ddp(x)
    sum(p.sum() for p in logged).backward()
    try:
        ddp(x)
        out["unfinished"] = None
    except RuntimeError as exc:
        out["unfinished"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenario, 3, timeout=120)  # type: ignore[no-any-return]


def test_gradients_equal_pytorchs_in_every_order(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}"


def test_most_hooks_only_log_once_the_order_is_known(results: list[dict[str, Any]]) -> None:
    for result in results:
        logged = result["logged"]
        # Set at the end of the first pass: 22 parameters, a few buckets.
        assert min(logged[:10]) >= 10
        # A hook of the user's appeared: Python hooks for good, called as usual.
        assert logged[10:] == [0, 0]
        assert result["foreign_calls"] == 2 * 2  # both DDPs, two steps


def test_static_graph_rebuilds_the_buckets_pytorchs_way(results: list[dict[str, Any]]) -> None:
    # Gradients bit for bit (in test_gradients_equal_pytorchs_in_every_order) need the
    # same buckets at every step: the rebuild comes one iteration later with a static
    # graph, from an order with the unused block last.
    for result in results:
        ours, theirs = result["reentrant_plans"]
        assert len(ours) > 3 and ours == theirs


def test_reentrant_backward_keeps_python_hooks(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["reentrant_logged"] == 0
        assert not result["reentrant_enabled"]


def test_a_pass_no_python_hook_saw_is_reported_at_the_next_forward(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        assert result["unfinished"] is not None
        assert "Expected to have finished reduction in the prior iteration" in result["unfinished"]
