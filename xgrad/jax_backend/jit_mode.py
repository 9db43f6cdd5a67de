"""The ``jit`` driver of the data-parallel step: XLA places and combines the reductions.

``jax.jit`` of ``jax.value_and_grad`` on the global batch, sharded over the step's mesh
with a ``NamedSharding``: GSPMD inserts the gradient all-reduces itself (no plan, no
hook), which shows what XLA's own combiner does to the numbers. Kept apart from the other
two drivers (:mod:`~xgrad.jax_backend.shard_map`, :mod:`~xgrad.jax_backend.pmap`), which
run xgrad's own bucketed reduction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xgrad.jax_backend.batch import normalize_in_axes, place

if TYPE_CHECKING:
    from xgrad.jax_backend.data_parallel import DataParallelStep


def jit_call(step: DataParallelStep, params: Any, batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """``step``'s call under ``jax.jit`` on a placed batch: ``(value, grads)``, compiled
    once per step (``jax.jit`` retraces for new shapes itself)."""
    fn = step._compiled.get("jit")
    if fn is None:
        fn = jax.jit(jax.value_and_grad(step.loss_fn, has_aux=step.has_aux))
        step._compiled["jit"] = fn
    return fn(params, *batch)  # type: ignore[no-any-return]


def compiled_text(step: DataParallelStep, params: Any, batch: tuple[Any, ...]) -> str:
    """The compiled program of ``mode="jit"`` for these arguments (XLA's HLO text), which
    the crosscheck reads for the reductions XLA chose."""
    if step.mode != "jit":
        raise ValueError(f"compiled_text is for mode='jit' (XLA's reductions), not {step.mode!r}")
    axes = normalize_in_axes(step.in_axes, len(batch))
    replicated = NamedSharding(step.mesh, P())
    split = NamedSharding(step.mesh, P(step.axis_name))
    placed = place(batch, axes, split, replicated, step.local_batch)
    params = jax.device_put(params, replicated)
    fn = jax.jit(jax.value_and_grad(step.loss_fn, has_aux=step.has_aux))
    return str(fn.lower(params, *placed).compile().as_text())
