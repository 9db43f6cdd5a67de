"""xgrad's DDP against PyTorch's at world size 3, bit for bit, option by option.

At world size 2 a bucket's layout cannot change the bits (gloo adds two numbers, and
a + b = b + a); at 3 the pre-divided gradients are summed in an order that depends on
where each one lies in its bucket, so a different bucket layout, a rebuild one
iteration early or late, or another first-bucket cap shows as last-bit differences.
One spawned gloo group of 3 ranks runs every setting: both DDPs on copies of one model
and the same data, ``.grad`` compared with ``torch.equal`` after each step, and the
bucket plans compared after the rebuild (or, where PyTorch never rebuilds, the sizes
of its initial buckets).

The model registers its head first, so gradients never arrive in registration order
(PyTorch's initial buckets are in reverse registration order), and it is over 1 MiB,
so the first bucket's cap matters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xgrad.torch_backend.spawn import spawn


class _Net(nn.Module):
    """A head registered first, an input layer, residual blocks, an optional branch."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.head = nn.Linear(width, 4)
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(5))
        self.branch = nn.Linear(width, width)
        self.use_branch = True
        self.reverse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        blocks = list(self.blocks)
        for block in reversed(blocks) if self.reverse else blocks:
            x = x + 0.5 * torch.tanh(block(x))
        if self.use_branch:
            x = x + torch.tanh(self.branch(x))
        return self.head(x)  # type: ignore[no-any-return]


_SMALL = {"bucket_cap_mb": 0.3}  # a few buckets (each block's weight is 256 KiB)

#: name -> (DDP arguments, steps, extra). A step is "+"-joined words: "nosync" (one
#: backward under ``no_sync()`` first), "unused" (the branch is not run), "reverse"
#: (the blocks run in reverse order). Extra: "late_static" (``_set_static_graph()``
#: after construction), "first_bucket" (``dist._DEFAULT_FIRST_BUCKET_BYTES`` lowered
#: while both DDPs are built).
_SETTINGS: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "default": ({}, ("plain",) * 4, ""),
    "default_reordered": ({}, ("reverse", "reverse", "plain"), ""),
    "small_buckets": ({"bucket_cap_mb": 0.05}, ("plain",) * 4, ""),
    "reordered": (_SMALL, ("reverse", "reverse", "plain", "reverse"), ""),
    "find_unused": (
        {**_SMALL, "find_unused_parameters": True},
        ("plain", "unused", "plain", "unused+reverse", "nosync"),
        "",
    ),
    "find_unused_first_step_unused": (
        {"find_unused_parameters": True},
        ("unused", "plain", "reverse+unused"),
        "",
    ),
    "static_unused": ({**_SMALL, "static_graph": True}, ("unused",) * 4, ""),
    "static_reordered": ({"static_graph": True}, ("reverse",) * 4, ""),
    "static_no_sync_second_step": (
        {**_SMALL, "static_graph": True},
        ("plain", "nosync", "plain", "plain"),
        "",
    ),
    "static_find_unused": (
        {**_SMALL, "static_graph": True, "find_unused_parameters": True},
        ("unused+reverse",) * 4,
        "",
    ),
    "gradient_as_bucket_view": (
        {**_SMALL, "gradient_as_bucket_view": True},
        ("plain", "reverse", "nosync+reverse", "plain"),
        "",
    ),
    "static_view_unused": (
        {**_SMALL, "static_graph": True, "gradient_as_bucket_view": True},
        ("unused+reverse", "nosync+unused+reverse", "unused+reverse"),
        "",
    ),
    "no_sync_accumulation": (_SMALL, ("plain", "nosync", "plain", "nosync"), ""),
    "no_sync_first_step": (_SMALL, ("nosync+reverse", "reverse", "reverse"), ""),
    "late_static_graph": (_SMALL, ("plain",) * 4, "late_static"),
    "late_static_unused": (_SMALL, ("unused", "unused", "nosync+unused"), "late_static"),
    "first_bucket_bytes": ({}, ("reverse", "reverse", "plain"), "first_bucket"),
    "first_bucket_bytes_find_unused": (
        {"find_unused_parameters": True},
        ("reverse", "unused", "plain"),
        "first_bucket",
    ),
}


def _torch_plan(ddp: Any) -> tuple[tuple[int, ...], ...] | str:
    """PyTorch's rebuilt buckets (parameter indices); its initial bucket sizes if none.

    Its logging data is refreshed at the start of each forward pass, before that pass
    rebuilds: refreshed here, it also shows a rebuild done by the last step.
    """
    ddp.logger.set_runtime_stats_and_log()
    data = ddp._get_ddp_logging_data()
    rebuilt = str(data.get("rebuilt_per_bucket_param_indices", ""))
    if not rebuilt:
        return "sizes " + str(data.get("bucket_sizes", "")).replace(" ", "")
    return tuple(tuple(int(i) for i in bucket.split()) for bucket in rebuilt.split(","))


def _xgrad_plan(ddp: Any, rebuilt: bool) -> tuple[tuple[int, ...], ...] | str:
    buckets = tuple(ddp.plan.buckets)
    if rebuilt:
        return buckets
    sizes = (sum(ddp._params[i].numel() * 4 for i in bucket) for bucket in buckets)
    return "sizes " + ",".join(map(str, sizes))


def _backward(ddp: Any, batches: list[torch.Tensor]) -> None:
    if len(batches) > 1:
        with ddp.no_sync():
            ddp(batches[0]).square().sum().backward()
    ddp(batches[-1]).square().sum().backward()


def _true_mean(local: nn.Module, world: int) -> list[torch.Tensor]:
    """The mean over ranks of each local gradient, in float64.

    One all-gather of every gradient raveled into one tensor (one per parameter made
    this check a third of the test's time); each element is summed over the ranks in
    the same order either way."""
    params = list(local.parameters())
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).double() for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    mean = sum(gathered) / world
    return [
        m.view_as(g) for m, g in zip(mean.split([g.numel() for g in grads]), grads, strict=True)
    ]


def _setting(rank: int, world: int, name: str) -> dict[str, Any]:
    """One setting: mismatches (with both errors against the true mean) and the plans."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    kwargs, steps, extra = _SETTINGS[name]
    torch.manual_seed(0)
    base = _Net()
    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    if extra == "first_bucket":
        dist._DEFAULT_FIRST_BUCKET_BYTES = 200 * 1024
    try:
        ours = DistributedDataParallel(copy.deepcopy(base), **kwargs)
        theirs = TorchDDP(copy.deepcopy(base), **kwargs)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved
    if extra == "late_static":
        ours._set_static_graph()
        theirs._set_static_graph()
    local = copy.deepcopy(base)  # this rank's own gradients, for the true mean
    mismatches: list[str] = []
    for step, how in enumerate(steps):
        batches = []
        for k in range(2 if "nosync" in how else 1):
            torch.manual_seed(1000 * step + 10 * rank + k)
            batches.append(torch.randn(6, 8))
        for module in (ours.module, theirs.module, local):
            module.use_branch = "unused" not in how
            module.reverse = "reverse" in how
            module.zero_grad(set_to_none=True)
        _backward(ours, batches)
        _backward(theirs, batches)
        for x in batches:
            local(x).square().sum().backward()
        true = _true_mean(local, world)
        named = zip(ours.module.named_parameters(), theirs.module.parameters(), true, strict=True)
        for (n, p), q, mean in named:
            if p.grad is None and q.grad is None:
                continue
            if p.grad is None or q.grad is None:
                mismatches.append(f"step {step} ({how}) {n}: a gradient is None")
            elif not torch.equal(p.grad, q.grad):
                mine = (p.grad.double() - mean).abs().max().item()
                torchs = (q.grad.double() - mean).abs().max().item()
                mismatches.append(
                    f"step {step} ({how}) {n}: xgrad {mine:.3g} and PyTorch {torchs:.3g} "
                    "from the true mean"
                )
        with torch.no_grad():
            params = zip(ours.parameters(), theirs.parameters(), local.parameters(), strict=True)
            for p, q, r in params:
                if q.grad is not None:
                    update = 0.01 * q.grad
                    p -= update
                    q -= update
                    r -= update
    theirs_plan = _torch_plan(theirs)
    ours_plan = _xgrad_plan(ours, rebuilt=not isinstance(theirs_plan, str))
    return {"mismatches": mismatches, "plans": (ours_plan, theirs_plan)}


def _static_no_sync_first(rank: int, world: int) -> list[str]:
    """A static graph whose first backward runs under ``no_sync()``, xgrad alone.

    PyTorch 2.13 stops at that backward with an internal assertion
    (``expect_autograd_hooks_``, from the static graph's delayed allreduce), so there
    are no PyTorch gradients to compare with: xgrad's must equal the true mean up to
    rounding, step after step.
    """
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _Net()
    ours = DistributedDataParallel(copy.deepcopy(base), static_graph=True, bucket_cap_mb=0.3)
    local = copy.deepcopy(base)
    wrong = []
    for step, how in enumerate(("nosync", "plain", "nosync+reverse", "reverse")):
        batches = []
        for k in range(2 if "nosync" in how else 1):
            torch.manual_seed(1000 * step + 10 * rank + k)
            batches.append(torch.randn(6, 8))
        for module in (ours.module, local):
            module.reverse = "reverse" in how
            module.zero_grad(set_to_none=True)
        _backward(ours, batches)
        for x in batches:
            local(x).square().sum().backward()
        true = _true_mean(local, world)
        for (n, p), mean in zip(ours.module.named_parameters(), true, strict=True):
            if p.grad is None or not torch.allclose(p.grad.double(), mean, rtol=1e-5, atol=1e-7):
                wrong.append(f"step {step} ({how}) {n}")
    return wrong


class _Sparse(nn.Module):
    """A sparse embedding (a bucket of its own) beside dense parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.sparse = nn.Embedding(50, 16, sparse=True)
        self.dense = nn.Embedding(30, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.sparse(idx) + self.dense(idx % 30)
        return self.head(torch.tanh(self.mid(x)))  # type: ignore[no-any-return]


def _sparse_and_join(rank: int) -> list[str]:
    """Sparse gradients, and uneven inputs under ``Join`` (rank r runs 2 + r steps)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    mismatches = []
    for kwargs in ({**_SMALL, "find_unused_parameters": True}, {"static_graph": True}):
        torch.manual_seed(0)
        base = _Sparse()
        ours = DistributedDataParallel(copy.deepcopy(base), **kwargs)
        theirs = TorchDDP(copy.deepcopy(base), **kwargs)
        for step in range(3):
            torch.manual_seed(10 * step + rank)
            idx = torch.randint(0, 50, (6, 3))
            for ddp in (ours, theirs):
                ddp.zero_grad(set_to_none=True)
                ddp(idx).square().sum().backward()
            for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                mine, torchs = p.grad, q.grad
                if mine.is_sparse:
                    mine, torchs = mine.coalesce().to_dense(), torchs.coalesce().to_dense()
                if not torch.equal(mine, torchs):
                    mismatches.append(f"sparse {kwargs} step {step} {n}")
    for kwargs in (_SMALL, {}):
        torch.manual_seed(0)
        base = _Net()
        grads = []
        for ddp in (
            DistributedDataParallel(copy.deepcopy(base), **kwargs),
            TorchDDP(copy.deepcopy(base), **kwargs),
        ):
            steps = []
            with Join([ddp]):
                for step in range(2 + rank):
                    torch.manual_seed(10 * step + rank)
                    ddp.zero_grad(set_to_none=True)
                    ddp(torch.randn(6, 8)).square().sum().backward()
                    steps.append([p.grad.clone() for p in ddp.parameters() if p.grad is not None])
            grads.append(steps)
        for step, (mine, torchs) in enumerate(zip(*grads, strict=True)):
            if len(mine) != len(torchs) or not all(map(torch.equal, mine, torchs)):
                mismatches.append(f"join {kwargs} step {step}")
    return mismatches


def _channels_last(rank: int) -> list[str]:
    """Convolutions in channels_last, where PyTorch lays each bucket view out with the
    parameter's strides (so the order gloo sums the elements in is the memory order)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Tanh(), nn.Conv2d(16, 32, 3), nn.Flatten())
    base = base.to(memory_format=torch.channels_last)  # type: ignore[call-arg]
    mismatches = []
    for kwargs in ({}, {"gradient_as_bucket_view": True}, {"hook": True}):
        hooked = kwargs.pop("hook", False)
        ours = DistributedDataParallel(copy.deepcopy(base), **kwargs)  # type: ignore[arg-type]
        theirs = TorchDDP(copy.deepcopy(base), **kwargs)  # type: ignore[arg-type]
        if hooked:  # PowerSGD views each of bucket.gradients() as a matrix
            for ddp in (ours, theirs):
                state = powerSGD.PowerSGDState(None, 1, start_powerSGD_iter=2)
                ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        for step in range(4):
            torch.manual_seed(10 * step + rank)
            x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
            for ddp in (ours, theirs):
                ddp.zero_grad(set_to_none=True)
                ddp(x).square().sum().backward()
            named = zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True)
            for (n, p), q in named:
                if not torch.equal(p.grad, q.grad) or p.grad.stride() != q.grad.stride():  # type: ignore[union-attr, arg-type]
                    mismatches.append(f"{kwargs} {hooked} step {step} {n}")
                with torch.no_grad():
                    p -= 0.01 * q.grad  # type: ignore[operator]
                    q -= 0.01 * q.grad  # type: ignore[operator]
    return mismatches


def _scenario(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: _setting(rank, world, name) for name in _SETTINGS}
    out["channels_last"] = _channels_last(rank)
    out["static_no_sync_first"] = _static_no_sync_first(rank, world)
    out["sparse_and_join"] = _sparse_and_join(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenario, 3, timeout=120)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(_SETTINGS))
def test_gradients_equal_pytorchs_bit_for_bit(results: list[dict[str, Any]], name: str) -> None:
    for rank, result in enumerate(results):
        assert result[name]["mismatches"] == [], f"rank {rank}"


@pytest.mark.parametrize("name", list(_SETTINGS))
def test_buckets_equal_pytorchs(results: list[dict[str, Any]], name: str) -> None:
    for result in results:
        ours, theirs = result[name]["plans"]
        assert ours == theirs
        if not isinstance(theirs, str):
            assert len(theirs) > 1  # several buckets: the layout could have differed


def test_a_static_graph_may_start_under_no_sync(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["static_no_sync_first"] == [], f"rank {rank}"


def test_sparse_gradients_and_uneven_inputs_equal_pytorchs(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        assert result["sparse_and_join"] == [], f"rank {rank}"


def test_channels_last_gradients_equal_pytorchs(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["channels_last"] == [], f"rank {rank}"
