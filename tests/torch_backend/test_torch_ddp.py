"""xgrad's DDP against PyTorch's DDP and the single-process full batch, on real gloo groups.

One spawned group per world size runs every scenario (spawning costs seconds, a scenario
milliseconds); each scenario returns the gradients of every step from xgrad's DDP, from
PyTorch's DDP on the same model, seeds and data, and from one process on the full batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

Grads = list[dict[str, np.ndarray]]

SHARD = 4  # samples per rank


class Branchy(nn.Module):
    """``b`` always used; ``c`` used only when ``use_c`` (an unused parameter otherwise)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8, dtype=dtype)
        self.b = nn.Linear(8, 3, dtype=dtype)
        self.c = nn.Linear(8, 3, dtype=dtype)
        self.use_c = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


class Toggling(Branchy):
    """``c`` used on every other forward pass: the unused set changes between iterations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.use_c = not self.use_c
        return super().forward(x)


class ManySmall(nn.Module):
    """A chain of 60 tiny layers: 120 small parameter tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(59))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for block in self.blocks:
            h = h + 0.1 * torch.tanh(block(h))
        return h[:, :3]


class TwoOutputs(nn.Module):
    """PyTorch's ``test_ignored_output`` pair: returns a tuple; ``unused`` never used."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10, bias=False)
        self.fc2 = nn.Linear(10, 3, bias=False)
        self.unused = nn.Linear(3, 3) if with_unused else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.fc1(x))
        return self.fc2(h), h


def _data(world: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SHARD * world, 6, generator=g, dtype=dtype)
    y = torch.randn(SHARD * world, 3, generator=g, dtype=dtype)
    return x, y


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple):
        out = out[0]
    return ((out - y) ** 2).mean()


def _grads(model: nn.Module) -> dict[str, np.ndarray]:
    return {
        n: p.grad.detach().float().cpu().numpy().copy()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _train(
    base: nn.Module,
    wrap: Callable[[nn.Module], nn.Module] | None,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int = 3,
    accumulate: int = 1,
) -> tuple[Grads, nn.Module | None]:
    """SGD steps; ``accumulate`` micro-batches per step (all but the last under no_sync)."""
    model = copy.deepcopy(base)
    ddp = wrap(model) if wrap is not None else None
    run = ddp if ddp is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: Grads = []
    for _ in range(steps):
        opt.zero_grad()
        for k in range(accumulate):
            last = k == accumulate - 1
            ctx = ddp.no_sync() if ddp is not None and not last else _nothing()  # type: ignore[operator]
            with ctx:
                _loss(run(x), y).backward()
        grads.append(_grads(model))
        opt.step()
    return grads, ddp


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _compare_three(
    rank: int, world: int, base: nn.Module, kw: dict[str, Any], **train: Any
) -> dict[str, Any]:
    """xgrad's DDP, PyTorch's DDP and the full batch (divided by ranks like DDP) on one model."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    dtype = next(base.parameters()).dtype
    x, y = _data(world, dtype)
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    ours, ddp = _train(base, lambda m: DistributedDataParallel(m, **kw), xs, ys, **train)
    theirs, torch_ddp = _train(base, lambda m: TorchDDP(m, **kw), xs, ys, **train)
    full, _ = _train(base, None, x, y, **train)
    assert isinstance(ddp, DistributedDataParallel) and isinstance(torch_ddp, TorchDDP)
    log = torch_ddp._get_ddp_logging_data()
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return {
        "xgrad": ours,
        "torch": theirs,
        "full": full,
        "stats": ddp.statistics(),
        "plan": ddp.plan,
        "grads_are_views": [
            p.grad is not None and p.grad.data_ptr() == v.data_ptr()
            for p, v in zip(params, ddp.reducer.bucket_views(), strict=True)
        ],
        "torch_rebuilt": str(log.get("rebuilt_per_bucket_param_indices", "")),
        "torch_ready": str(log.get("prev_iteration_grad_ready_order_indices", "")),
    }


M = TypeVar("M", bound=nn.Module)


def _seeded(factory: Callable[[], M]) -> M:
    torch.manual_seed(0)
    return factory()


def _hooks(rank: int, world: int) -> dict[str, Any]:
    """PyTorch's comm hooks and xgrad's neutral ones on xgrad's DDP."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import xgrad.hooks
    from xgrad.torch_backend import DistributedDataParallel

    base = _seeded(lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    x, y = _data(world)
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    out: dict[str, Any] = {"full": _train(base, None, x, y)[0]}
    # This rank's own gradients, for the analytic bf16 reference.
    local = _train(base, None, xs, ys, steps=1)[0][0]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    out["local"] = gathered

    def with_torch_hook(
        hook: Any, state: Any = None, **ddp_kwargs: Any
    ) -> Callable[[nn.Module], nn.Module]:
        def wrap(m: nn.Module) -> nn.Module:
            ddp = DistributedDataParallel(m, timeout=60, **ddp_kwargs)
            ddp.register_comm_hook(state, hook)
            return ddp

        return wrap

    def torch_ddp_with(hook: Any, state: Any = None) -> Callable[[nn.Module], nn.Module]:
        def wrap(m: nn.Module) -> nn.Module:
            ddp = TorchDDP(m)
            ddp.register_comm_hook(state, hook)
            return ddp

        return wrap

    for name, hook in (
        ("allreduce", default_hooks.allreduce_hook),
        ("fp16", default_hooks.fp16_compress_hook),
    ):
        out[f"torch-{name}"] = _train(base, torch_ddp_with(hook), xs, ys)[0]
        out[f"xgrad-{name}"] = _train(base, with_torch_hook(hook), xs, ys)[0]
    out["xgrad-bf16"] = _train(base, with_torch_hook(default_hooks.bf16_compress_hook), xs, ys)[0]
    for name in ("allreduce", "fp16", "bf16"):
        factory = xgrad.hooks.HOOKS[name]
        out[f"neutral-{name}"] = _train(
            base,
            lambda m, f=factory: DistributedDataParallel(m, comm_hook=f),  # type: ignore[misc]
            xs,
            ys,
        )[0]
    # PowerSGD with a rank as large as the matrices is exact; rank 1 really compresses.
    for rank_k in (8, 1):
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank_k,
            start_powerSGD_iter=2,
            min_compression_rate=0.1,
            orthogonalization_epsilon=0,
        )
        out[f"powersgd-{rank_k}"] = _train(
            base, with_torch_hook(psgd.powerSGD_hook, state), xs, ys, steps=4
        )[0]
        out[f"powersgd-{rank_k}-iter"] = state.iter
    # One bucket per tensor, all in flight at once, state cleared after the last one: on
    # gloo PowerSGD's callbacks issue collectives in completion order (PyTorch's DDP hangs).
    state = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=8,
        start_powerSGD_iter=2,
        min_compression_rate=0.1,
        orthogonalization_epsilon=0,
        warm_start=False,
    )
    out["powersgd-buckets"] = _train(
        base, with_torch_hook(psgd.powerSGD_hook, state, bucket_cap_mb=1e-5), xs, ys, steps=4
    )[0]
    out["full4"] = _train(base, None, x, y, steps=4)[0]
    # A wrapper that swaps the bucket's buffer around another hook: PowerSGD must read the
    # gradients from the fp16 buffer (PyTorch's GradBucket slices them from the current one).
    for who in ("xgrad", "torch"):
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        hook = default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook)
        wrap = with_torch_hook(hook, state) if who == "xgrad" else torch_ddp_with(hook, state)
        out[f"{who}-fp16-powersgd"] = _train(base, wrap, xs, ys, steps=4)[0]
    return out


def _ignored_output(rank: int, world: int, with_unused: bool) -> dict[str, Any]:
    """PyTorch's test_ignored_output(_with_unused_parameters): outputs dropped, then used."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    base = _seeded(lambda: TwoOutputs(with_unused))
    x, y = _data(world)
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    result = {}
    for name, cls in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        model = copy.deepcopy(base)
        ddp = cls(model, find_unused_parameters=with_unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            output = ddp(xs)
            del output
        grads = []
        for _ in range(4):
            opt.zero_grad()
            _loss(ddp(xs), ys).backward()
            grads.append(_grads(model))
            opt.step()
        result[name] = grads
    return result


def _errors(rank: int, world: int) -> dict[str, str]:
    """DDP's errors, with names and ranks; every one raised on every rank, none hanging."""
    from xgrad.torch_backend import DistributedDataParallel

    x, y = _data(world)
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    messages: dict[str, str] = {}

    width = 9 if rank == 1 else 8
    try:
        DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Linear(width, 3)))
    except ValueError as err:
        messages["mismatch"] = str(err)

    model = _seeded(Branchy)
    model.use_c = False
    ddp = DistributedDataParallel(model)
    _loss(ddp(xs), ys).backward()  # c got no gradient: the pass ends, as in PyTorch
    try:
        _loss(ddp(xs), ys).backward()
    except RuntimeError as err:  # PyTorch's error, at the next forward pass
        messages["no_grad"] = str(err)
    try:  # the failed step was given up on every rank (posted): the next one starts clean
        _loss(ddp(xs), ys).backward()
        messages["next"] = "no error"
    except RuntimeError as err:
        messages["next"] = str(err)

    model = _seeded(Branchy)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    model.use_c = False
    try:
        # c is found unused by the graph walk, yet gets a gradient outside forward.
        (_loss(ddp(xs), ys) + model.c.weight.sum()).backward()
    except RuntimeError as err:
        messages["twice"] = str(err)
    return messages


def _battery(rank: int, world: int) -> dict[str, Any]:
    def unused_model() -> nn.Module:
        m = Branchy()
        m.use_c = False
        return m

    out: dict[str, Any] = {
        "plain": _compare_three(rank, world, _seeded(Branchy), {}),
        "unused": _compare_three(
            rank, world, _seeded(unused_model), {"find_unused_parameters": True}
        ),
        "no_sync": _compare_three(rank, world, _seeded(Branchy), {}, accumulate=3),
        "many": _compare_three(rank, world, _seeded(ManySmall), {}),
    }
    if world == 2:
        out |= {
            "toggle": _compare_three(
                rank, world, _seeded(Toggling), {"find_unused_parameters": True}, steps=4
            ),
            "static": _compare_three(rank, world, _seeded(unused_model), {"static_graph": True}),
            "view": _compare_three(
                rank, world, _seeded(Branchy), {"gradient_as_bucket_view": True}
            ),
            "view_no_sync": _compare_three(
                rank, world, _seeded(Branchy), {"gradient_as_bucket_view": True}, accumulate=2
            ),
            "float64": _compare_three(rank, world, _seeded(lambda: Branchy(torch.float64)), {}),
            "bfloat16": _compare_three(rank, world, _seeded(lambda: Branchy(torch.bfloat16)), {}),
            "small_buckets": _compare_three(
                rank, world, _seeded(ManySmall), {"bucket_cap_mb": 0.0005}
            ),
            "ignored": _ignored_output(rank, world, False),
            "ignored_unused": _ignored_output(rank, world, True),
        }
    out["hooks"] = _hooks(rank, world)
    if world == 2:
        out["errors"] = _errors(rank, world)
    return out


Results = list[dict[str, Any]]


@pytest.fixture(scope="module")
def world2() -> Results:
    """Every scenario at world size 2, one result per rank."""
    return spawn(_battery, 2, timeout=240)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def world3() -> Results:
    """The core scenarios at world size 3 (where the order of a sum matters)."""
    return spawn(_battery, 3, timeout=240)  # type: ignore[no-any-return]


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def battery(request: pytest.FixtureRequest) -> tuple[int, Results]:
    return request.param, request.getfixturevalue(f"world{request.param}")


def _assert_equal(a: Grads, b: Grads, *, rtol: float, what: str) -> None:
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b, strict=True)):
        assert sorted(ga) == sorted(gb), f"{what} step {step}: gradient sets differ"
        for name in gb:
            scale = max(float(np.abs(gb[name]).max()), 1e-30)
            err = float(np.abs(ga[name] - gb[name]).max()) / scale
            assert err <= rtol, f"{what} step {step} {name}: relative error {err:.3g} > {rtol}"


def _check_three(world: int, results: Results, case: str) -> None:
    for rank, result in enumerate(results):
        r = result[case]
        # Same order of operations as PyTorch at two ranks: bit for bit.
        rtol = 0.0 if world == 2 else 1e-6
        _assert_equal(r["xgrad"], r["torch"], rtol=rtol, what=f"{case} r{rank}")
        # The full batch sums in another order: equal to rounding.
        tol = 1e-12 if case == "float64" else 1e-5
        _assert_equal(r["xgrad"], r["full"], rtol=tol, what=f"{case} r{rank} vs full batch")


@pytest.mark.parametrize("case", ["plain", "unused", "no_sync", "many"])
def test_matches_pytorch_ddp_and_full_batch(battery: tuple[int, Results], case: str) -> None:
    _check_three(*battery, case)


@pytest.mark.parametrize(
    "case", ["toggle", "static", "view", "view_no_sync", "float64", "small_buckets"]
)
def test_options_match_pytorch_ddp_and_full_batch(world2: Results, case: str) -> None:
    _check_three(2, world2, case)


def test_bfloat16_matches_pytorch(world2: Results) -> None:
    for result in world2:
        _assert_equal(
            result["bfloat16"]["xgrad"], result["bfloat16"]["torch"], rtol=0.0, what="bf16"
        )


def test_unused_parameters_keep_no_gradient(battery: tuple[int, Results]) -> None:
    _, results = battery
    for result in results:
        for step in result["unused"]["xgrad"]:
            assert "c.weight" not in step and "a.weight" in step


def test_plan_rebuilt_once_and_same_on_every_rank(
    battery: tuple[int, Results],
) -> None:
    _, results = battery
    stats = [r["many"]["stats"] for r in results]
    assert all(s["has_rebuilt_buckets"] for s in stats)
    assert len({s["plan"] for s in stats}) == 1
    assert stats[0]["plan"] != stats[0]["initial_plan"] or len(stats[0]["bucket_sizes"]) == 1
    # Gradients become ready last layer first.
    order = stats[0]["ready_order"]
    assert order[0].startswith("blocks.58") and order[-1].startswith("first.")
    assert stats[0]["avg_backward_time"] > 0 and stats[0]["avg_forward_time"] > 0
    assert stats[0]["iterations"] == 3
    timeline = stats[0]["timeline"]
    assert [t["iteration"] for t in timeline] == [0, 1, 2]
    for t in timeline:
        assert t["forward"] > 0 and t["backward"] >= t["backward_compute"] >= 0
        assert t["communication"] > 0 and 0 <= t["overlap"] <= t["communication"]
    # Under find_unused_parameters the initial plan is kept, as in DDP.
    assert not results[0]["unused"]["stats"]["has_rebuilt_buckets"]


@pytest.mark.parametrize("case", ["view", "view_no_sync"])
def test_gradients_are_bucket_views(world2: Results, case: str) -> None:
    for result in world2:
        assert all(result[case]["grads_are_views"])
    assert not any(world2[0]["plain"]["grads_are_views"])


def test_small_bucket_cap_gives_many_buckets(world2: Results) -> None:
    assert len(world2[0]["small_buckets"]["stats"]["bucket_sizes"]) > 5


@pytest.mark.parametrize("case", ["plain", "many", "small_buckets"])
def test_rebuilt_plan_and_ready_order_are_pytorchs(world2: Results, case: str) -> None:
    for result in world2:
        r = result[case]
        theirs = tuple(
            tuple(int(i) for i in bucket.split()) for bucket in r["torch_rebuilt"].split(",")
        )
        assert r["plan"].buckets == theirs
        ready = [int(i) for i in r["torch_ready"].split(",")]
        assert r["stats"]["ready_order_indices"] == ready


@pytest.mark.parametrize("case", ["ignored", "ignored_unused"])
def test_ignored_output(world2: Results, case: str) -> None:
    for result in world2:
        _assert_equal(result[case]["xgrad"], result[case]["torch"], rtol=0.0, what=case)


@pytest.mark.parametrize("name", ["allreduce", "fp16"])
def test_pytorch_hooks_match_pytorch_ddp(battery: tuple[int, Results], name: str) -> None:
    world, results = battery
    for result in results:
        h = result["hooks"]
        _assert_equal(
            h[f"xgrad-{name}"], h[f"torch-{name}"], rtol=0.0 if world == 2 else 1e-6, what=name
        )
        # The neutral hook does the same arithmetic.
        _assert_equal(
            h[f"neutral-{name}"], h[f"torch-{name}"], rtol=0.0 if world == 2 else 1e-6, what=name
        )


def test_a_hook_wrapping_powersgd_in_fp16_matches_pytorch_ddp(
    battery: tuple[int, Results],
) -> None:
    world, results = battery
    for result in results:
        h = result["hooks"]
        _assert_equal(
            h["xgrad-fp16-powersgd"],
            h["torch-fp16-powersgd"],
            rtol=0.0 if world == 2 else 1e-6,
            what="fp16_compress_wrapper(powerSGD_hook)",
        )


def test_fp16_hook_really_compresses(battery: tuple[int, Results]) -> None:
    _, results = battery
    h = results[0]["hooks"]
    a, b = h["xgrad-fp16"][0]["0.weight"], h["xgrad-allreduce"][0]["0.weight"]
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())


def test_bf16_hook_runs_on_cpu_and_matches_analytic_result(
    battery: tuple[int, Results],
) -> None:
    world, results = battery
    h = results[0]["hooks"]
    # PyTorch's arithmetic: cast each rank's bucket to bf16, divide, sum, cast back.
    expected = {}
    for name in h["local"][0]:
        parts = [torch.from_numpy(loc[name]).bfloat16() / world for loc in h["local"]]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        expected[name] = total.float().numpy()
    for key in ("xgrad-bf16", "neutral-bf16"):
        first = h[key][0]
        for name, value in expected.items():
            if world == 2:  # a sum of two is exact in any order
                np.testing.assert_array_equal(first[name], value, err_msg=f"{key} {name}")
            else:
                np.testing.assert_allclose(
                    first[name], value, rtol=0, atol=1e-2 * np.abs(value).max()
                )


def test_powersgd_runs_without_hanging(battery: tuple[int, Results]) -> None:
    _, results = battery
    for result in results:
        h = result["hooks"]
        assert h["powersgd-8-iter"] == 4 and h["powersgd-1-iter"] == 4
        # Full-rank approximation: the averaged gradient itself.
        _assert_equal(h["powersgd-8"], h["full4"], rtol=1e-5, what="powerSGD rank 8")
        _assert_equal(h["powersgd-buckets"], h["full4"], rtol=1e-5, what="powerSGD buckets")
        # Rank 1 from step 2 on: a real compression of the weight matrices.
        err = np.abs(h["powersgd-1"][3]["0.weight"] - h["full4"][3]["0.weight"]).max()
        assert err > 1e-4
        assert all(np.isfinite(g).all() for step in h["powersgd-1"] for g in step.values())


def test_errors_name_parameters_and_ranks(world2: Results) -> None:
    for rank, result in enumerate(world2):
        m = result["errors"]
        assert f"seen on rank {rank}" in m["mismatch"]
        assert "rank 1 has '1.weight' with shape [3, 9]" in m["mismatch"]
        assert "rank 0 has '1.weight' with shape [3, 8]" in m["mismatch"]
        assert m["no_grad"].startswith("Expected to have finished reduction in the prior")
        assert f"did not receive grad for rank {rank}: 4 5" in m["no_grad"], m["no_grad"]
        # PyTorch's DDP raises "Expected to have finished reduction in the prior iteration"
        # at every later forward; xgrad's posted the failure, so every rank gives the step
        # up and the next one runs (c is still unused: the pass ends, as the first did).
        assert m["next"] == "no error", m["next"]
        assert "marked as ready twice" in m["twice"] and "c.weight" in m["twice"]
    # Both ranks fail; every rank raises the first one posted, naming its rank, and the
    # other rank names its own failure after it (which rank posted first is a race).
    first = world2[0]["errors"]["twice"].split("\nalso ")[0]
    assert first.startswith(("rank 0 in gradient hook of c.weight", "rank 1 in")), first
    origin = int(first.split()[1])
    for rank, result in enumerate(world2):
        lines = result["errors"]["twice"].split("\nalso ")
        own = first.replace(f"rank {origin}", f"rank {rank}")  # "... twice on rank R."
        assert lines == ([first] if rank == origin else [first, own]), (rank, lines)


def _nccl(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    device = torch.device("cuda", rank)
    base = _seeded(Branchy).to(device)
    x, y = (t.to(device) for t in _data(world))
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    ours, _ = _train(base, lambda m: DistributedDataParallel(m, device_ids=[rank]), xs, ys)
    theirs, _ = _train(base, lambda m: TorchDDP(m, device_ids=[rank]), xs, ys)
    return {"xgrad": ours, "torch": theirs}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_on_cuda_matches_pytorch_ddp() -> None:
    world = min(torch.cuda.device_count(), 2)
    for result in spawn(_nccl, world, backend="nccl", timeout=240):
        _assert_equal(result["xgrad"], result["torch"], rtol=1e-6, what="nccl")
