"""Data parallelism on the reference backend: xgrad's engine and reducer, numpy ranks.

:class:`DataParallel` is DDP's life cycle in a few lines: rebuild buckets at the start of
forward, find unused parameters and prepare the reducer at its end, let the engine's
post-accumulate hooks mark gradients ready, finalize after the backward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from xgrad.backend import Comm
from xgrad.buckets import BucketPlan
from xgrad.ddp_setup import DDPLimits, ddp_reducer
from xgrad.dependencies import unused_parameters
from xgrad.engine import Engine, PassResult
from xgrad.hooks import HookSpec, resolve_hook
from xgrad.models import shard
from xgrad.numpy_ops import NumpyOps
from xgrad.reference.comm import ReferenceComm, spawn
from xgrad.reference.models import MLP, ForwardPass, build_model


class DataParallel:
    """A model replicated on one simulated rank, with DDP's gradient synchronisation.

    Args:
        model: the rank's replica.
        comm: the rank's communicator.
        plan: an explicit bucket plan (launch order); then buckets are never rebuilt.
        bucket_cap_bytes, first_bucket_cap_bytes: DDP's caps (see ``ddp_initial_plan``).
        find_unused_parameters, static_graph, gradient_as_bucket_view: as in DDP.
        hook: a communication hook (name or ``comm -> Hook`` factory).
    """

    def __init__(
        self,
        model: MLP,
        comm: Comm,
        *,
        plan: BucketPlan | None = None,
        bucket_cap_bytes: int | None = None,
        first_bucket_cap_bytes: int | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        hook: HookSpec = None,
    ) -> None:
        self.model = model
        self.comm = comm
        self.engine = Engine()
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        clock: Callable[[], float] = time.perf_counter
        if isinstance(comm, ReferenceComm) and comm.world.clock is not None:
            clock = comm.now
        self.reducer = ddp_reducer(
            model.params,
            comm,
            NumpyOps(),
            set_grad=self._set_grad,
            limits=DDPLimits.of(
                bucket_cap_bytes=bucket_cap_bytes,
                first_bucket_cap_bytes=first_bucket_cap_bytes,
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
            ),
            plan=plan,
            names=model.names,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            hook=resolve_hook(hook, comm),
            clock=clock,
        )
        for i in range(len(model.params)):
            self.engine.register_post_accumulate_hook(i, self.reducer.mark_ready)
        self._sync = True

    def _set_grad(self, index: int, view: Any) -> None:
        self.engine.grads[index] = view if self.gradient_as_bucket_view else view.copy()

    def forward(self, x: np.ndarray, y: np.ndarray) -> ForwardPass:
        """The replica's forward pass, then DDP's end-of-forward bookkeeping."""
        self.reducer.rebuild_buckets()
        fp = self.model.forward(x, y)
        if self._sync:
            unused: tuple[int, ...] = ()
            if self.find_unused_parameters and not self.static_graph:
                unused = unused_parameters(fp.graph, [fp.root], num_params=len(self.model.params))
            self.reducer.prepare_for_backward(unused)
        return fp

    def backward(self, fp: ForwardPass) -> PassResult:
        """Run the backward pass; reduced gradients are in :meth:`grads` afterwards."""
        seed = np.ones((), dtype=fp.loss.dtype)
        result = self.engine.backward(fp.graph, fp.functions, {fp.root: seed})
        if self._sync:
            self.reducer.finalize()
        return result

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synced backward after it reduces them."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def grads(self) -> dict[str, np.ndarray]:
        """Gradients by parameter name (parameters without a gradient are left out)."""
        return {
            self.model.names[i]: np.array(g, copy=True)
            for i, g in sorted(self.engine.grads.items())
        }


def run_data_parallel(
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    world_size: int,
    plan: BucketPlan | None = None,
    bucket_cap_bytes: int | None = None,
    hook: HookSpec = None,
    model: str = "mlp",
    steps: int = 1,
    find_unused_parameters: bool | None = None,
    static_graph: bool = False,
    timeout: float = 60.0,
) -> dict[str, np.ndarray]:
    """Averaged data-parallel gradients by parameter name, on ``world_size`` simulated ranks.

    Rank ``r`` takes the ``r``-th equal contiguous shard of ``(x, y)``. Each of ``steps``
    iterations zeroes the gradients and runs forward and backward (no optimizer step), so
    later steps exercise the bucket rebuild; the last step's gradients are returned. Every
    rank must end with the same bits (checked).

    Args:
        hook: ``None`` (DDP's default reduction), a name in ``xgrad.hooks.HOOKS`` or a
            factory ``comm -> Hook``.
        find_unused_parameters: default: on exactly when the model has unused parameters.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    probe = build_model(model, weights)
    for r in range(world_size):
        shard(x, world_size, r)
    find = bool(probe.unused) if find_unused_parameters is None else find_unused_parameters

    def rank_main(comm: ReferenceComm) -> dict[str, np.ndarray]:
        dp = DataParallel(
            build_model(model, weights),
            comm,
            plan=plan,
            bucket_cap_bytes=bucket_cap_bytes,
            hook=hook,
            find_unused_parameters=find,
            static_graph=static_graph,
        )
        xs, ys = shard(x, world_size, comm.rank), shard(y, world_size, comm.rank)
        for _ in range(steps):
            dp.zero_grad()
            dp.backward(dp.forward(xs, ys))
        return dp.grads()

    per_rank = spawn(rank_main, world_size, timeout=timeout)
    for r, grads in enumerate(per_rank[1:], start=1):
        for name, g in grads.items():
            if not np.array_equal(g, per_rank[0][name]):
                raise RuntimeError(f"rank {r} ended with a different gradient for {name!r}")
    return per_rank[0]


def single_process_grads(
    weights: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, model: str = "mlp"
) -> dict[str, np.ndarray]:
    """Full-batch gradients by name from one process (the reference answer).

    Parameters that get no gradient (unused ones) are left out, as their ``.grad`` stays
    ``None`` in torch.
    """
    m = build_model(model, weights)
    engine = Engine()
    fp = m.forward(x, y)
    engine.backward(fp.graph, fp.functions, {fp.root: np.ones((), dtype=fp.loss.dtype)})
    return {m.names[i]: g for i, g in sorted(engine.grads.items())}
