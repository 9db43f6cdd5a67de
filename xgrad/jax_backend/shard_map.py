"""The ``shard_map`` driver of the data-parallel step (the default one).

Each device differentiates its shard under ``jax.shard_map`` over the step's one-axis
mesh, and the step's per-device program reduces the gradients bucket by bucket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from xgrad.jax_backend.data_parallel import DataParallelStep
    from xgrad.jax_backend.uneven import Rows


def shard_map_call(
    step: DataParallelStep,
    params: Any,
    batch: tuple[Any, ...],
    axes: tuple[Any, ...],
    state: Any,
    rows: Rows | None = None,
) -> tuple[Any, ...]:
    """``step``'s call under ``jax.shard_map``: ``(value, grads[, hook_state])``; with
    ``rows``, ``batch`` is an uneven one padded (:mod:`~xgrad.jax_backend.uneven`)."""
    name = step.axis_name
    key = ("shard_map", axes, jax.tree_util.tree_structure(state), rows)
    fn = step._compiled.get(key)
    if fn is None:

        def body(params: Any, batch: tuple[Any, ...], *rest: Any) -> tuple[Any, ...]:
            state = rest[0] if rest else None
            # Differentiating a replicated input inside shard_map makes JAX insert its
            # own psum (the transpose of the implicit pvary); casting the parameters to
            # device-varying first keeps the reduction ours, bucket by bucket.
            params = jax.tree_util.tree_map(lambda p: lax.pcast(p, name, to="varying"), params)
            if state is not None:
                state = state._replace(errors=tuple(e[0] for e in state.errors))
            out = step._local(params, batch, state, stack_aux=True, rows=rows, axes=axes)
            if state is not None:
                new = out[-1]
                new = new._replace(errors=tuple(e[None] for e in new.errors))
                out = (*out[:-1], new)
            return out

        batch_specs = tuple(P() if a is None else P(name) for a in axes)
        state_specs = None if state is None else step._state_specs(state, P(name), P())
        out_specs: tuple[Any, ...] = (step._value_spec(P(name), P()), P())
        if state is not None:
            out_specs = (*out_specs, state_specs)
        fn = jax.jit(
            jax.shard_map(
                body,
                mesh=step.mesh,
                in_specs=(P(), batch_specs) if state is None else (P(), batch_specs, state_specs),
                out_specs=out_specs,
            )
        )
        step._compiled[key] = fn
    if state is not None:
        state = jax.device_put(
            state,
            step._state_specs(
                state,
                NamedSharding(step.mesh, P(name)),
                NamedSharding(step.mesh, P()),
            ),
        )
    args = (params, batch) if state is None else (params, batch, state)
    return fn(*args)  # type: ignore[no-any-return]
