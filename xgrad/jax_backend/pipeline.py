"""Pipeline schedules on JAX devices: one process, each rank's stages on its own device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from xgrad.pipeline import (
    Action,
    Invocation,
    Kind,
    Schedule,
    partitions_of,
    placement_of,
    sources_of,
    strip_comms,
    validate,
)
from xgrad.pipeline.simulate import dependencies

__all__ = ["StageFn", "pipeline_value_and_grad"]

#: ``apply(params, x) -> y`` of one partition.
StageFn = Callable[[Any, Any], Any]


def _partition_ids(schedule: Schedule, invocations: Sequence[Invocation] | None) -> list[int]:
    """Virtual stage -> partition number (partitions numbered by their first invocation)."""
    if invocations is None:
        return list(range(schedule.num_stages))
    if placement_of(invocations) != schedule.placement:
        raise ValueError(
            f"invocations place stages on {placement_of(invocations)}, "
            f"the schedule on {schedule.placement}"
        )
    srcs = sources_of(invocations)
    if any(ins != ((s - 1,) if s else ()) for s, ins in enumerate(srcs)):
        # Run as a chain, the skip connections were dropped: silently wrong gradients.
        raise ValueError(
            f"invocations form a DAG of stages (inputs {list(srcs)}); the JAX runtime runs "
            "chains only (the torch runtime runs DAGs)"
        )
    locs = partitions_of(invocations)
    number = {loc: i for i, loc in enumerate(dict.fromkeys(locs))}
    return [number[loc] for loc in locs]


def _batch_size(tree: Any, what: str, m: int) -> int:
    """The leading axis shared by every array leaf of ``tree`` (at least ``m`` rows)."""
    shapes = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(tree)]
    if not shapes or any(not shape for shape in shapes):
        raise ValueError(f"{what} need a batch axis on every array, got shapes {shapes}")
    sizes = sorted({int(shape[0]) for shape in shapes})
    if len(sizes) > 1:
        raise ValueError(f"{what} have arrays of different batch sizes {sizes}")
    if sizes[0] < m:
        # An empty microbatch would run every stage on nothing (and torch refuses it).
        raise ValueError(
            f"{what} batch size {sizes[0]} is smaller than the {m} microbatches: every "
            f"microbatch needs at least one row (give at least {m}, or fewer microbatches)"
        )
    return sizes[0]


def _microbatches(tree: Any, m: int, size: int) -> list[Any]:
    """``tree`` (``size`` rows) split along the leading axis of every leaf into ``m``
    pytrees, as ``torch.tensor_split`` splits: 10 rows into 4 are 3, 3, 2, 2."""
    # jnp.split for a multiple of m, as before; array_split puts the extra rows first.
    split = jnp.split if size % m == 0 else jnp.array_split
    parts = [split(leaf, m) for leaf in jax.tree_util.tree_leaves(tree)]
    treedef = jax.tree_util.tree_structure(tree)
    return [jax.tree_util.tree_unflatten(treedef, [p[i] for p in parts]) for i in range(m)]


def _global_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """Every rank's compute actions (overlapped pairs in turn) merged in an order that
    respects the dependencies."""
    queues = [schedule.compute(r) for r in range(schedule.num_ranks)]
    heads = [0] * schedule.num_ranks
    done: set[Action] = set()
    order: list[tuple[int, Action]] = []
    while len(order) < sum(len(q) for q in queues):
        for r, q in enumerate(queues):
            while heads[r] < len(q) and all(d in done for d in dependencies(schedule, q[heads[r]])):
                order.append((r, q[heads[r]]))
                done.add(q[heads[r]])
                heads[r] += 1
    return order


def pipeline_value_and_grad(
    schedule: Schedule,
    partitions: Sequence[StageFn],
    params: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    inputs: Any,
    targets: Any,
    *,
    invocations: Sequence[Invocation] | None = None,
    devices: Sequence[Any] | None = None,
    scale_grads: bool = True,
) -> tuple[Any, list[Any]]:
    """Run ``schedule`` with rank r's stages on ``devices[r]``; return loss and gradients.

    Activations and gradients move between ranks with ``jax.device_put``. The backward of a
    stage is a VJP; split backward (I, W) takes the VJP with respect to the input at I and
    with respect to the parameters at W (which linearises the stage again from its saved
    input). The loss of each microbatch is scaled by 1/m, so for a mean loss over a batch
    that m divides the result equals ``jax.value_and_grad`` of the whole model on it.

    A batch size that m does not divide splits as torch's ``tensor_split`` and the torch
    runtime split it (10 rows into 4 microbatches: 3, 3, 2, 2, the larger first), and each
    microbatch's loss still counts 1/m whatever its rows, as in torch's schedules: the
    loss and gradients are the mean over the m microbatch losses, not the whole batch's
    mean loss (a row of a 2-row microbatch weighs 1/8, one of a 3-row one 1/12); a summed
    loss with ``scale_grads=False`` still gives the whole batch's sum.
    The stages run op by op, each op compiled once per shape, so an uneven batch costs at
    most one more shape (q + 1 and q rows, q = batch // m) than an even one.

    Args:
        schedule: a valid schedule (comms, if any, are implicit here and dropped).
        partitions: ``apply(params, x)`` per partition; without ``invocations`` partition k
            is virtual stage k, with them partitions are numbered by first invocation.
        params: a pytree per partition.
        loss_fn: ``loss_fn(output, target)``, a mean over the microbatch.
        inputs: the whole batch, an array or a pytree of arrays (each leading axis split
            into m microbatches; at least m rows).
        targets: its targets (the same batch size, split alike).
        invocations: fairscale-style invocations (a partition may run at several stages;
            its gradient is the sum).
        devices: one device per rank (default: the first p of ``jax.devices()``).
        scale_grads: scale each microbatch's loss by 1/m (default, for a mean loss), as
            torch's schedules do; False for a loss that sums over its batch (the loss and
            gradients are then sums over the microbatches).

    Returns:
        ``(loss, grads)``, grads a pytree per partition (on its rank's device).

    Raises:
        ValueError: a batch smaller than m (naming its size and m: an empty microbatch),
            targets of another batch size, a loss that is not a scalar, partitions or
            devices that do not match the schedule.
        TypeError: a schedule that is not a ``Schedule``, a ``scale_grads`` not a bool.
    """
    if not isinstance(scale_grads, bool):
        raise TypeError(f"scale_grads={scale_grads!r} must be a bool")
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be an xgrad.pipeline.Schedule (e.g. xgrad.pipeline.make(name, p, "
            f"m)), got {type(schedule).__name__} {schedule!r}"
        )
    schedule = validate(strip_comms(schedule))
    if not schedule.is_chain:
        raise ValueError(
            f"schedule {schedule.name!r} is a DAG of stages (inputs {schedule.inputs}); the JAX "
            "runtime runs chains only (the torch runtime runs DAGs)"
        )
    ids = _partition_ids(schedule, invocations)
    if len(partitions) != len(params) or len(partitions) != max(ids) + 1:
        # More than the schedule runs would leave some silently out of the model.
        raise ValueError(
            f"the schedule runs {max(ids) + 1} partitions, got {len(partitions)} partitions "
            f"and {len(params)} param trees"
        )
    p, m, n = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    devs = list(jax.devices()[:p] if devices is None else devices)
    if len(devs) < p:
        raise ValueError(f"schedule has {p} ranks, only {len(devs)} devices: {devs}")
    batch, target_batch = _batch_size(inputs, "inputs", m), _batch_size(targets, "targets", m)
    if target_batch != batch:
        raise ValueError(f"targets have batch size {target_batch}, the inputs {batch}")
    rank_of_part = {ids[s]: schedule.placement[s] for s in range(n)}
    placed = [jax.device_put(params[k], devs[rank_of_part[k]]) for k in range(len(params))]
    grads: list[Any] = [jax.tree_util.tree_map(jnp.zeros_like, t) for t in placed]
    xs, ys = _microbatches(inputs, m, batch), _microbatches(targets, m, batch)

    ys_on = [jax.device_put(y, devs[schedule.placement[-1]]) for y in ys]

    def run(s: int, prm: Any, x: Any, mb: int) -> Any:
        y = partitions[ids[s]](prm, x)
        if s < n - 1:
            return y
        loss = loss_fn(y, ys_on[mb])
        return loss / m if scale_grads else loss

    saved: dict[tuple[int, int], Any] = {}  # (stage, mb) -> (input, VJP wrt the input)
    arriving: dict[tuple[int, int], Any] = {}  # (stage, mb) -> its input from stage - 1
    cotangent: dict[tuple[int, int], Any] = {}  # (stage, mb) -> gradient of its output
    loss: Any = 0.0
    ones: dict[int, Any] = {}  # microbatch -> the cotangent of its loss (the loss's dtype)
    for r, a in _global_order(schedule):
        s, mb = a.stage, a.microbatch
        dev = devs[r]
        prm = placed[ids[s]]
        if a.kind is Kind.FORWARD:
            x = jax.device_put(xs[mb] if s == 0 else arriving.pop((s, mb)), dev)
            y, vjp_x = jax.vjp(lambda x_, _s=s, _p=prm, _mb=mb: run(_s, _p, x_, _mb), x)
            saved[(s, mb)] = (x, vjp_x)
            if s == n - 1:
                if jnp.shape(y) != ():
                    raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(y)}")
                ones[mb] = jnp.ones((), dtype=jnp.result_type(y))
                loss = loss + jax.device_put(y, devs[schedule.placement[-1]])
            else:
                arriving[(s + 1, mb)] = jax.device_put(y, devs[schedule.placement[s + 1]])
            continue
        x, vjp_x = saved[(s, mb)]
        g = ones[mb] if s == n - 1 else cotangent[(s, mb)]
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and s > 0:
            (dx,) = vjp_x(g)
            cotangent[(s - 1, mb)] = jax.device_put(dx, devs[schedule.placement[s - 1]])
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            _, vjp_p = jax.vjp(lambda q, _s=s, _x=x, _mb=mb: run(_s, q, _x, _mb), prm)
            (dp,) = vjp_p(g)
            grads[ids[s]] = jax.tree_util.tree_map(jnp.add, grads[ids[s]], dp)
            saved.pop((s, mb))
            cotangent.pop((s, mb), None)
    return loss, grads
