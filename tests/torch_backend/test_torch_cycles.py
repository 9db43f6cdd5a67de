"""xgrad's per-step paths leave nothing for the cyclic garbage collector.

An object in a reference cycle outlives its last use until the collector runs, and all it
holds (tensors, the autograd graph they hold) with it; enough of them bring on full
collections, tens of milliseconds each in a step of a few (a ledger <-> context cycle in
distributed autograd once did this on every pass). One run of two gloo ranks goes through
every scenario with the collector off: it builds the scenario and runs ``WARMUP`` steps
(one-time garbage: buckets rebuilt, a group made), puts everything so far out of the
collector's sight (``gc.freeze``), runs ``STEPS`` steps with ``gc.DEBUG_SAVEALL`` and
collects: what that finds is the garbage those steps made. Failures too: a step in which
rank 1 raises (DDP: in backward, a comm hook, forward; a pipeline stage; a distributed
backward pass), every rank raising its error, then a good step.

Which garbage is xgrad's: PyTorch makes a few cycles of its own on some of these paths
(its pytree flattening, about 7 objects a call; the casts of mixed precision, about 12 a
step), with no tensor in them, which are not xgrad's to judge. The garbage is split into
its connected pieces (objects linked by references among the garbage), and a piece is
xgrad's when it holds a tensor (what a cycle costs) or anything from an ``xgrad`` module:
an instance of its classes, a function, a method, a frame of its code (an exception's
traceback). No scenario may leave such a piece; the other garbage is only counted, in the
message. A control step that makes one such cycle shows the judge finds one per step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from garbage import describe, is_xgrads, pieces
from ranks import run_ranks

torch = pytest.importorskip("torch")

#: steps whose garbage is judged, after WARMUP steps whose garbage is not.
STEPS, WARMUP = 4, 3
SHARD = 4


def _judge(step: Callable[[], None]) -> dict[str, Any]:
    """The garbage of ``STEPS`` calls of ``step`` after ``WARMUP`` (collector off).

    Returns the xgrad pieces (each as its sorted type names) and the number of other
    objects found.
    """
    import gc

    for _ in range(WARMUP):
        step()
    # Everything so far (the warm-up's garbage too) out of the collector's sight: the
    # collection below looks at the steps' objects only (a full one takes ~0.3 s here).
    gc.freeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(STEPS):
            step()
        gc.collect()
        found = pieces(gc.garbage)
        ours = [describe(p) for p in found if any(map(is_xgrads, p))]
        others = sum(len(p) for p in found if not any(map(is_xgrads, p)))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()
    return {"xgrad": ours, "others": others}


# -- scenarios: each builds its objects and returns one step --------------------------


class _Branchy(torch.nn.Module):
    """``c`` is used on every other forward (an unused parameter that comes and goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.c = torch.nn.Linear(8, 3)
        self.use_c = True

    def forward(self, x: Any) -> Any:
        self.use_c = not self.use_c
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


def _data(rank: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(SHARD, 6, generator=g), torch.randn(SHARD, 3, generator=g)


def _ddp_step(
    rank: int,
    *,
    branchy: bool = False,
    torch_hook: Any = None,
    hook_state: Callable[[], Any] = lambda: None,
    in_backward: bool = False,
    delayed: bool = False,
    join: bool = False,
    **kwargs: Any,
) -> Callable[[], None]:
    """A DDP training step; ``join``: under ``join()``, rank r with r + 1 batches (uneven)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    from xgrad.torch_backend.ddp import DistributedDataParallel

    torch.manual_seed(0)
    model: Any = (
        _Branchy()
        if branchy
        else torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    )
    if delayed:  # the last layer reduced when the first layer's weight is ready
        kwargs["delay_all_reduce_named_params"] = list(model[2].named_parameters(prefix="2"))
        kwargs["param_to_hook_all_reduce"] = model[0].weight
    opt = None
    if in_backward:
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.01})
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = DistributedDataParallel(model, timeout=30, **kwargs)
    if torch_hook is not None:
        ddp.register_comm_hook(hook_state(), torch_hook)
    x, y = _data(rank)

    def step() -> None:
        if opt is not None:
            opt.zero_grad()
        with ddp.join() if join else contextlib.nullcontext():
            for _ in range(rank + 1 if join else 1):
                ((ddp(x) - y) ** 2).mean().backward()
        if opt is not None:
            opt.step()

    return step


def _no_sync_step(rank: int) -> Callable[[], None]:
    """Two microbatches: the first under ``no_sync`` (gradients kept), the second reduced."""
    from xgrad.torch_backend.ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ddp = DistributedDataParallel(model, timeout=30)
    x, y = _data(rank)

    def step() -> None:
        model.zero_grad()
        with ddp.no_sync():
            ((ddp(x) - y) ** 2).mean().backward()
        ((ddp(x) - y) ** 2).mean().backward()

    return step


def _pipeline_step(rank: int, world: int, name: str, **kwargs: Any) -> Callable[[], None]:
    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, world, 2 * world, chunks=2)
    torch.manual_seed(0)
    parts = [
        torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
        for _ in range(schedule.num_stages)
    ]
    mine = [parts[s] for s in schedule.stages_of(rank)]
    rt = PipelineRuntime(schedule, mine, torch.nn.functional.mse_loss, timeout=30, **kwargs)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank

    def step() -> None:
        for part in mine:
            part.zero_grad(set_to_none=True)
        rt.step(x if first else None, y if last else None)

    return step


def _chain_step(rank: int) -> Callable[[], None]:
    """Rank 0 sends, rank 1 computes the loss: one hop."""
    from xgrad.torch_backend import dist_autograd as da

    w = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def step() -> None:
        with da.context(timeout=30) as cid:
            if rank == 0:
                da.send(torch.tanh(w * 2), 1)
                roots = []
            else:
                roots = [(da.recv(0) * w).sum()]
            da.backward(cid, roots)
            da.get_gradients(cid)

    return step


def _round_trip_step(rank: int) -> Callable[[], None]:
    """Rank 0 sends, rank 1 computes and sends back, rank 0 computes the loss."""
    from xgrad.torch_backend import dist_autograd as da

    w = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def step() -> None:
        with da.context(timeout=30) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                roots = [(da.recv(1) * w).sum()]
            else:
                da.send(torch.sin(da.recv(0) * w), 0)
                roots = []
            da.backward(cid, roots)
            da.get_gradients(cid)

    return step


def _failing_ddp_step(rank: int, where: str) -> Callable[[], None]:
    """A DDP step in which rank 1 raises (in ``where``: its backward, comm hook or forward;
    every rank raises, naming it), then a good step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from xgrad.torch_backend.ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ddp = DistributedDataParallel(model, timeout=30)
    x, y = _data(rank)
    failing = [False]

    def fault(here: str) -> None:
        if failing[0] and rank == 1 and here == where:
            raise RuntimeError(f"a failure on purpose in {where}")

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        fault("comm hook")
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    model[0].register_forward_pre_hook(lambda module, args: fault("forward"))
    model[0].weight.register_hook(lambda grad: fault("backward"))

    def step() -> None:
        model.zero_grad()
        failing[0] = True
        try:
            ((ddp(x) - y) ** 2).mean().backward()
        except RuntimeError as exc:
            assert ("on purpose" if rank == 1 else "rank 1") in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: the step failing in {where} did not raise")
        failing[0] = False
        model.zero_grad()
        with warnings.catch_warnings():  # the failed step's gradients dropped: expected
            warnings.simplefilter("ignore")
            ((ddp(x) - y) ** 2).mean().backward()

    return step


def _failing_pipeline_step(rank: int, world: int) -> Callable[[], None]:
    """A 1F1B pipeline step in which rank 1's stage raises in a forward, then a good step."""
    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    failing = [False]

    class Stage(torch.nn.Linear):
        def forward(self, x: Any) -> Any:
            if failing[0] and rank == 1:
                raise RuntimeError("a failure on purpose")
            return torch.tanh(super().forward(x))

    torch.manual_seed(0)
    part = Stage(6, 6)
    rt = PipelineRuntime(xp.one_f_one_b(world, 4), [part], torch.nn.functional.mse_loss, timeout=30)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    first, last = rank == 0, rank == world - 1

    def step() -> None:
        failing[0] = True
        try:
            rt.step(x if first else None, y if last else None)
        except RuntimeError as exc:
            assert "rank 1" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: the failing step did not raise")
        failing[0] = False
        part.zero_grad(set_to_none=True)
        rt.step(x if first else None, y if last else None)

    return step


def _failing_pass_step(rank: int) -> Callable[[], None]:
    """A distributed backward pass in which rank 1's part raises, then a good pass."""
    from failing import failing_function

    from xgrad.torch_backend import dist_autograd as da

    boom = failing_function("Boom", lambda: ValueError("a failure on purpose"))
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def one(fail: bool) -> None:
        with da.context(timeout=30) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                roots = []
            else:
                h = da.recv(0) * w
                roots = [(boom.apply(h) if fail else h).sum()]
            da.backward(cid, roots)

    def step() -> None:
        try:
            one(True)
        except RuntimeError as exc:
            assert "rank 1" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: the failing pass did not raise")
        one(False)

    return step


def _crosscheck_step(rank: int, world: int) -> Callable[[], None]:
    """The crosscheck's torch runner on one rank: a DDP built, a warm-up and a timed step."""
    from xgrad import models as zoo
    from xgrad.torch_backend.crosscheck import _rank_main

    weights = zoo.init_weights("mlp", 0, "float32")
    x, y = zoo.make_batch("mlp", 0, 4 * world, "float32")
    settings = {
        "model": "mlp", "weights": weights, "x": x, "y": y, "implementation": "xgrad",
        "plan": None, "bucket_cap_mb": None, "hook": None, "steps": 1, "timeout": 30.0,
        "device": "cpu", "powersgd": None,
    }  # fmt: skip

    def step() -> None:
        _rank_main(rank, world, settings)

    return step


def _control_step(rank: int, world: int) -> Callable[[], None]:
    """One cycle holding a tensor per step: what the judge must find."""

    def step() -> None:
        held: list[Any] = [torch.ones(2)]
        held.append(held)

    return step


def _mixed_step(rank: int, world: int) -> Callable[[], None]:
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
    return _ddp_step(rank, mixed_precision=mixed)


def _fp16_hook_step(rank: int, world: int) -> Callable[[], None]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return _ddp_step(rank, torch_hook=default_hooks.fp16_compress_hook)


def _xgrad_fp16_hook_step(rank: int, world: int) -> Callable[[], None]:
    from xgrad.hooks import HOOKS

    return _ddp_step(rank, comm_hook=HOOKS["fp16"])


def _powersgd_step(rank: int, world: int) -> Callable[[], None]:
    """PyTorch's PowerSGD hook, compressing from the second step (the warm-up's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def state() -> Any:
        return psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)

    return _ddp_step(rank, torch_hook=psgd.powerSGD_hook, hook_state=state)


#: name -> (rank, world) -> one step of the scenario, built.
SCENARIOS: dict[str, Callable[[int, int], Callable[[], None]]] = {
    "ddp": lambda rank, world: _ddp_step(rank),
    "ddp_find_unused": lambda rank, world: _ddp_step(
        rank, branchy=True, find_unused_parameters=True
    ),
    "ddp_static_graph": lambda rank, world: _ddp_step(rank, static_graph=True),
    "ddp_no_sync": lambda rank, world: _no_sync_step(rank),
    "ddp_fp16_hook": _fp16_hook_step,
    "ddp_bucket_view": lambda rank, world: _ddp_step(rank, gradient_as_bucket_view=True),
    "ddp_mixed_precision": _mixed_step,
    "ddp_xgrad_fp16_hook": _xgrad_fp16_hook_step,
    "ddp_powersgd_hook": _powersgd_step,
    "ddp_in_backward_optimizer": lambda rank, world: _ddp_step(rank, in_backward=True),
    "ddp_delayed_all_reduce": lambda rank, world: _ddp_step(rank, delayed=True),
    "ddp_join_uneven": lambda rank, world: _ddp_step(rank, join=True),
    "pipeline_1f1b": lambda rank, world: _pipeline_step(rank, world, "1f1b"),
    "pipeline_zb_h1": lambda rank, world: _pipeline_step(rank, world, "zb_h1"),
    "pipeline_interleaved_1f1b": lambda rank, world: _pipeline_step(
        rank, world, "interleaved_1f1b"
    ),
    "pipeline_1f1b_recompute_always": lambda rank, world: _pipeline_step(
        rank, world, "1f1b", checkpoint="always"
    ),
    "pipeline_1f1b_checkpoint_never": lambda rank, world: _pipeline_step(
        rank, world, "1f1b", checkpoint="never"
    ),
    "dist_autograd_chain": lambda rank, world: _chain_step(rank),
    "dist_autograd_round_trip": lambda rank, world: _round_trip_step(rank),
    "crosscheck_runner": _crosscheck_step,
    **{
        f"ddp_{where.replace(' ', '_')}_failed_then_good": (
            lambda rank, world, where=where: _failing_ddp_step(rank, where)
        )
        for where in ("backward", "comm hook", "forward")
    },
    "pipeline_failed_then_good": _failing_pipeline_step,
    "dist_autograd_failed_then_good": lambda rank, world: _failing_pass_step(rank),
}


def _all(rank: int, world: int) -> dict[str, dict[str, Any]]:
    import gc
    import time

    gc.collect()
    gc.disable()
    out = {}
    try:
        for name, build in {"control": _control_step, **SCENARIOS}.items():
            start = time.perf_counter()
            out[name] = _judge(build(rank, world))
            out[name]["seconds"] = time.perf_counter() - start
    finally:
        gc.enable()
    return out


@pytest.fixture(scope="module")
def judged() -> dict[int, dict[str, dict[str, Any]]]:
    results, codes = run_ranks(_all, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    for rank, (status, value) in results.items():
        assert status == "ok", (rank, value)
    return {rank: value for rank, (_, value) in results.items()}


def test_the_judge_finds_a_cycle_made_in_each_step(judged: Any) -> None:
    for rank in (0, 1):
        assert len(judged[rank]["control"]["xgrad"]) == STEPS, (rank, judged[rank]["control"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_steps_leave_no_cycles_of_xgrads(judged: Any, name: str) -> None:
    found = {rank: judged[rank][name] for rank in (0, 1)}
    assert not any(f["xgrad"] for f in found.values()), "\n".join(
        f"rank {rank}, {name}: {len(f['xgrad'])} pieces of garbage of xgrad's in {STEPS} "
        f"steps ({f['others']} other objects):\n  " + "\n  ".join(f["xgrad"])
        for rank, f in found.items()
    )
