"""PyTorch 2.13 DDP's full surface on xgrad's DDP, against PyTorch's DDP on real gloo groups.

One spawned 2-process group runs every option (spawning costs seconds, an option
milliseconds): for each constructor argument the gradients after a few SGD steps must
equal PyTorch's DDP under the same argument, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

WORLD = 2
SHARD = 4


class Net(nn.Module):
    """Dense layers, an unused branch (``c``), a buffer and an optional sparse embedding."""

    def __init__(self, sparse: bool = False, use_c: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=sparse)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.c = nn.Linear(8, 3)
        self.norm = nn.BatchNorm1d(8)
        self.use_c = use_c

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.a(self.emb(idx))))
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    idx = torch.randint(0, 10, (SHARD * WORLD,), generator=g)
    y = torch.randn(SHARD * WORLD, 3, generator=g)
    return idx[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]


def _grads(model: nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad
            out[n] = g.detach().float().numpy().copy()
    return out


def _train(
    rank: int,
    base: nn.Module,
    wrap: Callable[[nn.Module], nn.Module],
    steps: int = 3,
    optimizer: bool = True,
) -> tuple[list[dict[str, np.ndarray]], nn.Module, nn.Module]:
    model = copy.deepcopy(base)
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    x, y = _batch(rank)
    grads = []
    for _ in range(steps):
        model.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        grads.append(_grads(model))
        if opt is not None:
            opt.step()
    return grads, ddp, model


def _both(rank: int, base: nn.Module, **kw: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    ours, ddp, _ = _train(rank, base, lambda m: DistributedDataParallel(m, **kw))
    theirs, _, _ = _train(rank, base, lambda m: TorchDDP(m, **kw))
    return {"xgrad": ours, "torch": theirs, "stats": ddp.statistics()}


def _seeded(**kw: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def _mixed_reference(rank: int, base: nn.Module, mp: Any) -> list[dict[str, np.ndarray]]:
    """DDP mixed precision written out: compute in param_dtype, sum in reduce_dtype, divide."""
    import torch.distributed as dist

    model = copy.deepcopy(base)
    for b in model.buffers():  # every one, as PyTorch's _cast_buffers
        b.data = b.to(mp.buffer_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(rank)
    grads = []
    for _ in range(3):
        model.zero_grad()
        for b in model.buffers():
            dist.broadcast(b, 0)
        full = {id(p): p.data for p in model.parameters()}
        for p in model.parameters():
            p.data = p.data.to(mp.param_dtype)
        ((model(x) - y) ** 2).mean().backward()
        for p in model.parameters():
            g = p.grad.to(mp.reduce_dtype)
            dist.all_reduce(g)
            g.div_(WORLD)
            p.data = full[id(p)]
            p.grad = g.to(p.data.dtype)
        grads.append(_grads(model))
        opt.step()
    return grads


def _options(rank: int, world: int) -> dict[str, Any]:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {
        "bucket_cap_mb_list": _both(rank, _seeded(), bucket_cap_mb_list=[0.0005, 0.001]),
        "skip_unused": _both(
            rank,
            _seeded(use_c=False),
            find_unused_parameters=True,
            skip_all_reduce_unused_params=True,
            bucket_cap_mb=0.00001,  # a bucket per parameter: c's buckets are skipped
        ),
        "batched_grad_copy": _both(rank, _seeded(), batched_grad_copy=True),
        "batched_view": _both(
            rank, _seeded(), batched_grad_copy=True, gradient_as_bucket_view=True
        ),
        "forward_sync_buffers": _both(rank, _seeded(), forward_sync_buffers=False),
        "device_mesh": _both(rank, _seeded(), device_mesh=init_device_mesh("cpu", (world,))),
        "sparse": _both(rank, _seeded(sparse=True)),
        "sparse_static": _both(rank, _seeded(sparse=True), static_graph=True),
    }
    from torch.nn.parallel.distributed import _MixedPrecision

    for name, mp in {
        "mixed_bf16": _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
        "mixed_fp16": _MixedPrecision(torch.float16, torch.float16, torch.float16),
    }.items():
        ours, _, _ = _train(
            rank, _seeded(), lambda m, mp=mp: DistributedDataParallel(m, mixed_precision=mp)
        )
        out[name] = {"xgrad": ours, "reference": _mixed_reference(rank, _seeded(), mp)}
        # gradient_as_bucket_view: the reduced result is written back into the buckets,
        # which hold param_dtype (as PyTorch's), and the gradients are full-precision
        # copies of them (PyTorch's mixed precision needs CUDA: no reference run here).
        viewed, _, _ = _train(
            rank,
            _seeded(),
            lambda m, mp=mp: DistributedDataParallel(
                m, mixed_precision=mp, gradient_as_bucket_view=True
            ),
        )
        rounded = [
            {k: torch.from_numpy(v).to(mp.param_dtype).float().numpy() for k, v in step.items()}
            for step in out[name]["reference"]
        ]
        # Compared at the first step: later steps start from parameters updated with
        # these rounded gradients, so their reference would be another run.
        out[name + "_view"] = {"xgrad": viewed[:1], "reference": rounded[:1]}
    # A sparse gradient (its own bucket) under mixed precision: reduced in reduce_dtype as
    # the dense ones and upcast to the parameter's dtype (assigning a bfloat16 one raised).
    mp = _MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    ours, _, model = _train(
        rank, _seeded(sparse=True), lambda m: DistributedDataParallel(m, mixed_precision=mp)
    )
    out["mixed_bf16_sparse"] = {
        "xgrad": ours,
        "reference": _mixed_reference(rank, _seeded(sparse=True), mp),
        "dtype": str(model.emb.weight.grad.dtype),
    }
    # buffer_dtype casts every buffer, BatchNorm's integer count too: PyTorch's construction
    # (which runs on the CPU) leaves the same dtypes.
    out["buffer_dtypes"] = {}
    for label, cls in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        model = _seeded()
        cls(model, mixed_precision=_MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16))
        out["buffer_dtypes"][label] = {n: str(b.dtype) for n, b in model.named_buffers()}
    base = _seeded()
    delayed = [("a.weight", base.a.weight), ("a.bias", base.a.bias)]

    def delay(cls: Any) -> Callable[[nn.Module], nn.Module]:
        def wrap(m: nn.Module) -> nn.Module:
            params = dict(m.named_parameters())
            return cls(
                m,
                delay_all_reduce_named_params=[(n, params[n]) for n, _ in delayed],
                param_to_hook_all_reduce=m.emb.weight,
            )

        return wrap

    def delayed_grads(cls: Any) -> list[dict[str, np.ndarray]]:
        model = copy.deepcopy(base)
        ddp = delay(cls)(model)
        x, y = _batch(rank)
        ((ddp(x) - y) ** 2).mean().backward()
        # PyTorch never waits for its delayed all-reduce (CUDA streams order it); on gloo
        # a barrier queued behind it does. xgrad's DDP waits at the end of backward.
        torch.distributed.barrier()
        return [_grads(model)]

    out["delay_all_reduce"] = {
        "xgrad": delayed_grads(DistributedDataParallel),
        "torch": delayed_grads(TorchDDP),
    }

    # _set_static_graph after construction, as PyTorch's reentrant-checkpoint users do.
    def late_static(cls: Any) -> Callable[[nn.Module], nn.Module]:
        def wrap(m: nn.Module) -> nn.Module:
            ddp = cls(m)
            ddp._set_static_graph()
            return ddp

        return wrap

    ours, _, _ = _train(rank, _seeded(use_c=False), late_static(DistributedDataParallel))
    theirs, _, _ = _train(rank, _seeded(use_c=False), late_static(TorchDDP))
    out["set_static_graph"] = {"xgrad": ours, "torch": theirs}

    # _register_fused_optim: the optimizer runs in the communication hook.
    def fused(cls: Any) -> Callable[[nn.Module], nn.Module]:
        def wrap(m: nn.Module) -> nn.Module:
            ddp = cls(m)
            ddp._register_fused_optim(torch.optim.SGD, 0.1)
            return ddp

        return wrap

    _, _, ours_model = _train(rank, _seeded(), fused(DistributedDataParallel), optimizer=False)
    _, _, torch_model = _train(rank, _seeded(), fused(TorchDDP), optimizer=False)
    out["fused_optim"] = {
        "xgrad": [{n: p.detach().numpy().copy() for n, p in ours_model.named_parameters()}],
        "torch": [{n: p.detach().numpy().copy() for n, p in torch_model.named_parameters()}],
    }

    model = _seeded()
    ddp = DistributedDataParallel(model)
    tddp = TorchDDP(copy.deepcopy(model))
    x, _ = _batch(rank)
    attrs = ("_has_rebuilt_buckets", "_delay_all_reduce_all_params", "_use_python_reducer")
    attrs += ("_lazy_init_ran",)
    out["attrs_before"] = [[getattr(d, a) for a in attrs] for d in (ddp, tddp)]
    for d in (ddp, tddp):
        for _ in range(2):
            d(x).sum().backward()
    out["attrs_after"] = [[getattr(d, a) for a in attrs] for d in (ddp, tddp)]
    out["module_parameters"] = [
        [p.shape for p in d._module_parameters] for d in (ddp, tddp)
    ]  # the ZeRO overlap hook reads these
    out["isinstance"] = isinstance(ddp, TorchDDP)
    out["logging_keys"] = sorted(ddp._get_ddp_logging_data())
    out["torch_logging_keys"] = sorted(tddp._get_ddp_logging_data())
    out["bucket_bytes_cap"] = (ddp.bucket_bytes_cap, tddp.bucket_bytes_cap)
    out["join"] = (ddp.join_device, ddp.join_process_group is tddp.join_process_group)
    # Logging values PyTorch reports, in its formats, after a rebuild into several buckets
    # (its ``bucket_sizes`` stay the construction-time ones).
    model = _seeded().double()
    pair = (
        DistributedDataParallel(model, bucket_cap_mb=0.0005),
        TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.0005),
    )
    for d in pair:
        for _ in range(3):
            d(x).sum().backward()
    keys = (
        "dtypes",
        "bucket_sizes",
        "rebuilt_bucket_sizes",
        "rebuilt_per_bucket_param_indices",
        "num_buckets_reduced",
    )
    out["logging_values"] = [{k: d._get_ddp_logging_data().get(k) for k in keys} for d in pair]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_options, WORLD, timeout=240)


NAMES = [
    "bucket_cap_mb_list",
    "skip_unused",
    "batched_grad_copy",
    "batched_view",
    "forward_sync_buffers",
    "device_mesh",
    "sparse",
    "sparse_static",
    "delay_all_reduce",
    "set_static_graph",
    "fused_optim",
]


@pytest.mark.parametrize("name", NAMES)
def test_option_matches_pytorch(results: list[dict[str, Any]], name: str) -> None:
    for rank_result in results:
        ours, theirs = rank_result[name]["xgrad"], rank_result[name]["torch"]
        assert len(ours) == len(theirs)
        for mine, ref in zip(ours, theirs, strict=True):
            assert mine.keys() == ref.keys()
            for key in ref:
                np.testing.assert_array_equal(mine[key], ref[key], err_msg=f"{name}: {key}")


def test_sparse_gradient_has_its_own_bucket(results: list[dict[str, Any]]) -> None:
    plan = results[0]["sparse"]["stats"]["plan"]
    assert [0] in [list(b) for b in __import__("json").loads(plan)["buckets"]]


def test_isinstance_and_attributes(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert r["isinstance"]
    for key in ("attrs_before", "attrs_after", "module_parameters"):
        ours, theirs = r[key]
        assert ours == theirs, (key, ours, theirs)
    assert r["bucket_bytes_cap"][0] == r["bucket_bytes_cap"][1]
    assert r["join"] == (torch.device("cpu"), True)
    environment = {k for k in r["torch_logging_keys"] if k.startswith(("gloo_", "master_"))}
    environment |= {"cuda_visible_devices", "torch_distributed_debug"}
    timestamps = {k for k in r["torch_logging_keys"] if k.endswith(("_start", "_end", "_time"))}
    wanted = set(r["torch_logging_keys"]) - environment - timestamps
    assert wanted <= set(r["logging_keys"])


def test_logging_values_equal_pytorchs(results: list[dict[str, Any]]) -> None:
    for r in results:
        ours, theirs = r["logging_values"]
        assert ours == theirs


def test_mixed_precision_casts_the_buffers_pytorch_casts(results: list[dict[str, Any]]) -> None:
    # Was float buffers only: num_batches_tracked stayed int64, PyTorch's is bfloat16.
    for r in results:
        dtypes = r["buffer_dtypes"]
        assert dtypes["xgrad"] == dtypes["torch"], dtypes
        assert dtypes["xgrad"]["norm.num_batches_tracked"] == "torch.bfloat16"


def test_mixed_precision_on_cpu(results: list[dict[str, Any]]) -> None:
    """PyTorch's mixed precision needs stream events (no CPU); the reference is by hand."""
    for r in results:
        assert r["mixed_bf16_sparse"]["dtype"] == "torch.float32"
        names = ("mixed_bf16", "mixed_fp16", "mixed_bf16_view", "mixed_fp16_view")
        for name in (*names, "mixed_bf16_sparse"):
            ours, ref = r[name]["xgrad"], r[name]["reference"]
            for mine, want in zip(ours, ref, strict=True):
                assert mine.keys() == want.keys()
                for key in want:
                    np.testing.assert_array_equal(mine[key], want[key], err_msg=f"{name}: {key}")
