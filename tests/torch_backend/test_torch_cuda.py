"""On CUDA (``make gpu``): xgrad's DDP, distributed autograd and pipeline runtime on the GPU.

Each group of scenarios runs in one spawned group: DDP against PyTorch's DDP on NCCL (one
rank per GPU, so one rank on a one-GPU machine: NCCL refuses two ranks on one GPU), the
same under ``torch.compile`` with inductor (Triton kernels), and two ranks sharing the GPU
on gloo (CUDA tensors over gloo: DDP, distributed autograd's sends and receives, the
pipeline runtime). Every group also runs on the CPU (gloo, two ranks), so the scenarios
themselves are checked on machines without a GPU, where the ``cuda`` variants skip.

A scenario that raises is recorded, not fatal, so one run on a borrowed GPU reports every
scenario; each rank prints a line per scenario, shown when a test fails.
"""

from __future__ import annotations

import copy
import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from sparse_alone import sparse_alone  # noqa: E402
from torch import nn  # noqa: E402

from xgrad.torch_backend.spawn import spawn  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA])]

Grads = list[dict[str, np.ndarray]]
SHARD = 4


class Net(nn.Module):
    """``a`` then ``b``; ``c`` only while ``use_c`` (an unused parameter otherwise); an
    optional sparse embedding in front."""

    def __init__(self, sparse: bool = False, use_c: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=True) if sparse else None
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)
        self.c = nn.Linear(16, 3)
        self.norm = nn.BatchNorm1d(16)
        self.use_c = use_c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = x + self.emb((x.abs() * 3).long().clamp(max=9)).mean(1)
        h = torch.tanh(self.norm(self.a(x)))
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


def _data(rank: int, device: torch.device, steps: int = 3) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(SHARD, 6, generator=g).to(device),
            torch.randn(SHARD, 3, generator=g).to(device),
        )
        for _ in range(steps)
    ]


def _grads(model: nn.Module) -> dict[str, np.ndarray]:
    return {
        n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().double().cpu().numpy()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _train(
    rank: int,
    device: torch.device,
    base: nn.Module,
    wrap: Callable[[nn.Module], Any],
    *,
    accumulate: int = 1,
    hook: Callable[[], tuple[Any, Any]] | None = None,
    compiled: bool = False,
) -> Grads:
    """Three SGD steps through ``wrap(model)``; ``accumulate`` micro-batches per step, all
    but the last under ``no_sync``; ``hook()`` gives ``(state, hook)`` to register."""
    model = copy.deepcopy(base).to(device)
    ddp = wrap(model)
    if hook is not None:
        ddp.register_comm_hook(*hook())
    run = torch.compile(ddp, backend="inductor") if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: Grads = []
    for x, y in _data(rank, device):
        opt.zero_grad()
        for k in range(accumulate):
            last = k == accumulate - 1
            with ddp.no_sync() if not last else _Nothing():
                ((run(x) - y) ** 2).mean().backward()
        out.append(_grads(model))
        opt.step()
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _both(rank: int, device: torch.device, base: nn.Module, **kw: Any) -> dict[str, Any]:
    """The same training through xgrad's DDP and PyTorch's; each side's outcome (its
    gradients, or the error it raised: both must agree on whether it works)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    train = {k: kw.pop(k) for k in ("accumulate", "hook", "compiled") if k in kw}
    ids = [device.index] if device.type == "cuda" else None
    out: dict[str, Any] = {}
    for label, cls in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        torch.manual_seed(0)
        try:
            out[label] = _train(
                rank, device, base, lambda m, cls=cls: cls(m, device_ids=ids, **kw), **train
            )
        except Exception as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _mixed(rank: int, device: torch.device, base: nn.Module, mp: Any) -> dict[str, Any]:
    """Both DDPs under mixed precision ``mp``, and DDP mixed precision written out:
    buffers in ``buffer_dtype``, parameters and inputs cast to ``param_dtype`` for the
    forward, each gradient summed in ``reduce_dtype``, divided, cast back."""
    import torch.distributed as dist

    out = _both(rank, device, base, mixed_precision=mp)
    model = copy.deepcopy(base).to(device)
    for b in model.buffers():
        b.data = b.to(mp.buffer_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: Grads = []
    for x, y in _data(rank, device):
        opt.zero_grad()
        for b in model.buffers():
            dist.broadcast(b, 0)
        full = {id(p): p.data for p in model.parameters()}
        for p in model.parameters():
            p.data = p.data.to(mp.param_dtype)
        ((model(x.to(mp.param_dtype)) - y) ** 2).mean().backward()
        for p in model.parameters():
            g = p.grad.to(mp.reduce_dtype)
            dist.all_reduce(g)
            g.div_(dist.get_world_size())
            p.data = full[id(p)]
            p.grad = g.to(p.data.dtype)
        grads.append(_grads(model))
        opt.step()
    out["reference"] = grads
    return out


def _seeded(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return Net(**kw)


def _powersgd() -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    state = ps.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
        min_compression_rate=0.5, random_seed=0,
    )  # fmt: skip
    return state, ps.powerSGD_hook


def _hook(name: str) -> Callable[[], tuple[Any, Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return lambda: (None, getattr(default_hooks, name))


def _ddp_scenarios(device: torch.device) -> dict[str, Callable[[int], Any]]:
    from torch.nn.parallel.distributed import _MixedPrecision

    cuda = device.type == "cuda"
    mixed = _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
    return {
        "default": lambda r: _both(r, device, _seeded()),
        "find_unused": lambda r: _both(
            r, device, _seeded(use_c=False), find_unused_parameters=True
        ),
        "static_graph": lambda r: _both(r, device, _seeded(use_c=False), static_graph=True),
        "bucket_view": lambda r: _both(
            r, device, _seeded(), gradient_as_bucket_view=True, bucket_cap_mb=0.0005
        ),
        "no_sync": lambda r: _both(r, device, _seeded(), accumulate=2),
        "fp16_hook": lambda r: _both(r, device, _seeded(), hook=_hook("fp16_compress_hook")),
        # PyTorch's bf16 hook refuses to run without CUDA (it checks NCCL's bf16 support).
        "bf16_hook": lambda r: (
            _both(r, device, _seeded(), hook=_hook("bf16_compress_hook")) if cuda else None
        ),
        # PyTorch's PowerSGD hangs at its first compressed step on gloo's CPU here.
        "powersgd": lambda r: _both(r, device, _seeded(), hook=_powersgd) if cuda else None,
        # PyTorch's mixed precision needs CUDA (its casts run on a side stream).
        "mixed_bf16": lambda r: _mixed(r, device, _seeded(), mixed) if cuda else None,
        # On NCCL PyTorch's DDP refuses sparse gradients: xgrad's, which sums them by
        # all-gather there, is checked against one process (sparse_one_process).
        "sparse": lambda r: _both(r, device, _seeded(sparse=True)) if not cuda else None,
        "sparse_one_process": lambda r: sparse_alone(r, device, steps=3, shard=SHARD),
    }


def _compile_scenarios(device: torch.device) -> dict[str, Callable[[int], Any]]:
    return {
        "compile_inductor": lambda r: _both(r, device, _seeded(), compiled=True),
        "compile_find_unused": lambda r: _both(
            r, device, _seeded(use_c=False), compiled=True, find_unused_parameters=True
        ),
    }


# --------------------------------------------------------------- distributed autograd


def _leaves(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(*s, generator=g, dtype=torch.float64).to(device).requires_grad_()
        for k, s in (("x", (4, 3)), ("w0", (3,)), ("w1", (3,)))
    }


def _round_trip(rank: int, device: torch.device) -> float:
    """0 sends to 1, 1 sends two tensors back; gradients equal the one-process ones."""
    from xgrad.torch_backend import dist_autograd as da

    P = _leaves(device)
    a = P["x"] * P["w0"]
    c = torch.tanh(a) * P["w1"]
    mine = [P["x"], P["w0"]] if rank == 0 else [P["w1"]]
    want = torch.autograd.grad((c * P["w0"]).sum() + (a * a).sum() + (a * a).sum(), mine)
    with da.context(timeout=30) as cid:
        roots = []
        if rank == 0:
            a = P["x"] * P["w0"]
            da.send(a, 1)
            # Received tensors land where the group receives (the CPU on gloo); ``.to`` is
            # part of the graph, so the gradient goes back the same way.
            c2, d = (da.recv(1).to(device) for _ in range(2))
            roots = [(c2 * P["w0"]).sum() + (a * a).sum(), d.sum()]
        else:
            r = da.recv(0).to(device)
            da.send(torch.tanh(r) * P["w1"], 0)
            da.send(r * r, 0)
        da.backward(cid, roots)
        got = da.get_gradients(cid)
    return max(
        float((got[leaf].to(w.device) - w).abs().max()) for leaf, w in zip(mine, want, strict=True)
    )


def _local_pass(rank: int, device: torch.device) -> float:
    """A context with no sends: each rank's own backward, gradients in the context."""
    from xgrad.torch_backend import dist_autograd as da

    P = _leaves(device)
    loss = (torch.sin(P["x"] @ P["w0"]) * rank + P["w1"].sum()).sum()
    want = torch.autograd.grad(loss, [P["x"], P["w0"], P["w1"]], retain_graph=True)
    with da.context(timeout=30) as cid:
        da.backward(cid, [loss])
        got = da.get_gradients(cid)
    return max(
        float((got[t] - w).abs().max()) for t, w in zip(P.values(), want, strict=True) if w.any()
    )


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom on the GPU")


def _failure(rank: int, device: torch.device) -> dict[str, Any]:
    """Rank 1's node raises in backward: both ranks raise naming it, soon; then a good pass."""
    from xgrad.torch_backend import dist_autograd as da

    P = _leaves(device)
    start = time.monotonic()
    try:
        with da.context(timeout=30) as cid:
            if rank == 1:
                da.send(_Boom.apply(P["w1"] * 2), 0)
                da.backward(cid, [])
            else:
                da.backward(cid, [(da.recv(1).to(device) * P["w0"]).sum()])
        error = "no error"
    except da.DistBackwardError as exc:
        error = f"rank {exc.rank}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start, "after": _round_trip(rank, device)}


def _dist_scenarios(device: torch.device) -> dict[str, Callable[[int], Any]]:
    return {
        "local_pass": lambda r: _local_pass(r, device),
        "round_trip": lambda r: _round_trip(r, device),
        "failure": lambda r: _failure(r, device),
    }


def _nccl_dist_scenarios(device: torch.device) -> dict[str, Callable[[int], Any]]:
    """The same passes on the DDP's group (NCCL on CUDA): a world of one GPU has no
    peer to send to, so only its local pass runs there."""
    import torch.distributed as dist

    two = dist.get_world_size() >= 2
    return {
        "local_pass": lambda r: _local_pass(r, device),
        "round_trip": lambda r: _round_trip(r, device) if two else None,
    }


# --------------------------------------------------------------------------- pipelines


def _pipeline(rank: int, world: int, device: torch.device, name: str) -> float:
    """Schedule ``name`` over ``world`` ranks (two stages each for the interleaved ones)
    against the whole model on the whole batch, on ``device``: the largest relative
    difference of this rank's gradients."""
    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, world, 2 * world, chunks=2)
    torch.manual_seed(0)
    parts = [
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double().to(device)
        for _ in range(schedule.num_stages)
    ]
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(4 * world, 8, generator=g, dtype=torch.float64).to(device) for _ in "xy")
    whole = copy.deepcopy(parts)
    out = x
    for part in whole:
        out = part(out)
    nn.functional.mse_loss(out, y).backward()
    mine = schedule.stages_of(rank)
    rt = PipelineRuntime(schedule, [parts[s] for s in mine], nn.functional.mse_loss, timeout=30)
    first, last = schedule.placement[0], schedule.placement[-1]
    rt.step(x if rank == first else None, y if rank == last else None)
    worst = 0.0
    for s in mine:
        for p, q in zip(parts[s].parameters(), whole[s].parameters(), strict=True):
            assert p.grad is not None and p.grad.device == device, (name, s, p.grad)
            worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm()))
    return worst


def _pipeline_scenarios(device: torch.device) -> dict[str, Callable[[int], Any]]:
    return {
        name: functools.partial(_pipeline, world=2, device=device, name=name)
        for name in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
    }


# ------------------------------------------------------------------------------ running

GROUPS: dict[str, Callable[[torch.device], dict[str, Callable[[int], Any]]]] = {
    "ddp": _ddp_scenarios,
    "compile": _compile_scenarios,
    "dist": _dist_scenarios,
    "nccl_dist": _nccl_dist_scenarios,
    "pipeline": _pipeline_scenarios,
}


def _run(rank: int, world: int, group: str, kind: str) -> dict[str, tuple[str, Any]]:
    if kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out: dict[str, tuple[str, Any]] = {}
    for name, scenario in GROUPS[group](device).items():
        start = time.monotonic()
        try:
            out[name] = ("ok", scenario(rank))
        except Exception as exc:
            out[name] = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        print(
            f"[{group} {kind} rank {rank}] {name}: {out[name][0]} in {time.monotonic() - start:.1f} s",
            flush=True,
        )
    return out


def _layout(group: str, kind: str) -> tuple[int, str]:
    """(world, backend): NCCL ranks one per GPU; gloo on two ranks (sharing a GPU)."""
    if kind == "cuda" and group in ("ddp", "compile", "nccl_dist"):
        return min(GPUS, 2), "nccl"
    return 2, "gloo"


@functools.cache
def _outcome(group: str, kind: str) -> list[dict[str, tuple[str, Any]]]:
    world, backend = _layout(group, kind)
    timeout = 400 if group == "compile" else 180
    return spawn(
        _run,
        world,
        args=(group, kind),
        backend=backend,
        timeout=timeout,
        num_threads=None if kind == "cuda" else 1,
    )


def _scenario(group: str, kind: str, name: str) -> list[Any]:
    """Every rank's value of one scenario; a scenario that raised fails here with its text;
    one that does not apply to ``kind`` (None on every rank) skips."""
    results = [per_rank[name] for per_rank in _outcome(group, kind)]
    for status, value in results:
        assert status == "ok", value
    values = [value for _, value in results]
    if all(v is None for v in values):
        pytest.skip(f"{name} has no reference on {kind}")
    return values


def _differences(ours: Grads, theirs: Grads) -> dict[str, float]:
    """Per step and parameter, the largest difference (only those that differ)."""
    return {
        f"{step}:{k}": float(np.abs(a[k] - b[k]).max())
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True))
        for k in a
        if not np.array_equal(a[k], b[k])
    }


def _identical(side: dict[str, Any], name: str) -> None:
    ours, theirs = side["xgrad"], side["torch"]
    if "reference" in side:
        # Mixed precision: xgrad's against the arithmetic written out (as on the CPU, where
        # they are bit-identical and PyTorch's cannot run). On an H200 (torch 2.11) xgrad's
        # and PyTorch's first-step gradients differed by up to 0.31: which one departs
        # from the arithmetic was not established (the run that would tell ran out of
        # time), so PyTorch's difference is reported with a failure, not asserted.
        off = {k: _differences(side[k], side["reference"]) for k in ("xgrad", "torch")}
        assert not off["xgrad"], (name, off)
        return
    if isinstance(theirs, str) or isinstance(ours, str):
        # Both refuse alike (e.g. a collective the backend lacks), or neither does.
        assert isinstance(ours, str) and isinstance(theirs, str), (name, ours, theirs)
        # xgrad's names the rank and the hook where PyTorch's error came from.
        assert theirs.split(": ", 1)[1] in ours, (name, ours, theirs)
        return
    assert len(ours) == len(theirs) == 3, name
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.keys() == b.keys(), (name, step, sorted(a), sorted(b))
        for k in a:
            diff = float(np.abs(a[k] - b[k]).max())
            assert diff == 0.0, f"{name} step {step} {k}: max difference {diff:.3g}"


DDP_NAMES = [n for n in _ddp_scenarios(torch.device("cpu")) if n != "sparse_one_process"]


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", DDP_NAMES)
def test_ddp_equals_pytorchs_ddp(kind: str, name: str) -> None:
    for side in _scenario("ddp", kind, name):
        _identical(side, name)


@pytest.mark.parametrize("kind", DEVICES)
def test_sparse_gradients_on_nccl_equal_one_process(kind: str) -> None:
    """On CUDA the DDP's group is NCCL, which has no sparse all-reduce (PyTorch's DDP
    refuses there); xgrad's sums the sparse bucket by all-gather."""
    for rank, value in enumerate(_scenario("ddp", kind, "sparse_one_process")):
        assert value["gathered"], (rank, value)
        assert value["worst"] <= 1e-12, (rank, value)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (on the CPU: test_torch_ddp_compile)")
@pytest.mark.parametrize("name", ["compile_inductor", "compile_find_unused"])
def test_compiled_ddp_equals_compiled_pytorch_ddp(name: str) -> None:
    for side in _scenario("compile", "cuda", name):
        ours, theirs = side["xgrad"], side["torch"]
        assert not isinstance(ours, str) and not isinstance(theirs, str), (ours, theirs)
        for a, b in zip(ours, theirs, strict=True):
            for k in a:
                scale = max(float(np.abs(b[k]).max()), 1e-12)
                assert float(np.abs(a[k] - b[k]).max()) <= 1e-5 * scale, (name, k)


@pytest.mark.parametrize("kind", DEVICES)
def test_dist_autograd_gradients_equal_one_process(kind: str) -> None:
    for name in ("local_pass", "round_trip"):
        assert max(_scenario("dist", kind, name)) <= 1e-12, name


@pytest.mark.parametrize("kind", DEVICES)
def test_dist_autograd_on_nccl_equals_one_process(kind: str) -> None:
    assert max(_scenario("nccl_dist", kind, "local_pass")) <= 1e-12
    results = [per_rank["round_trip"] for per_rank in _outcome("nccl_dist", kind)]
    assert all(status == "ok" for status, _ in results), results
    values = [v for _, v in results if v is not None]
    assert not values or max(values) <= 1e-12, values


@pytest.mark.parametrize("kind", DEVICES)
def test_dist_autograd_failure_is_named_then_the_next_pass_works(kind: str) -> None:
    for rank, value in enumerate(_scenario("dist", kind, "failure")):
        assert value["error"].startswith("rank 1: "), (rank, value)
        assert "boom on the GPU" in value["error"], value
        assert value["seconds"] < 10, value
        assert value["after"] <= 1e-12, value


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zbv"])
def test_pipeline_runtime_on_the_device_equals_the_whole_model(kind: str, name: str) -> None:
    assert max(_scenario("pipeline", kind, name)) <= 1e-12, name
