"""A JAX function's backward graph, read from its jaxpr, as xgrad's ``BackwardGraph``.

The graph has the shape PyTorch's autograd would give the same computation: one
``function`` node per equation that has a gradient to pass back, one ``accumulate`` node per
parameter leaf, and an edge from each equation to the producer of each of its inputs that
carries a gradient (edge ``input_nr`` is which of the producer's outputs it was). A value
carries a gradient when it is floating point and computed from a parameter through
differentiable equations: ``stop_gradient`` (torch's ``detach``) and integer-valued results
cut the graph. Calls with an inner jaxpr (``jit``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat``) are inlined; control flow (``scan``, ``while``, ``cond``) stays one node whose
outputs depend on all its inputs, which can only make more parameters look used.

With it, :func:`xgrad.graph.compute_dependencies` and DDP's unused-parameter search run on
JAX models and agree with the torch backend on the same model.

Example:
    >>> import jax.numpy as jnp
    >>> def f(p, x):
    ...     return jnp.tanh(x @ p["w"])  # p["v"] takes no part
    >>> find_unused_parameters(f, {"w": jnp.ones((2, 2)), "v": jnp.ones(2)}, jnp.ones((1, 2)),
    ...                        names=["w", "v"])
    (1,)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from xgrad.graph import BackwardGraph, Dependencies, GraphBuilder, compute_dependencies
from xgrad.graph import unused_parameters as graph_unused_parameters
from xgrad.jax_backend.reduce import leaf_names, plan_order

#: primitives whose outputs carry no gradient back to their inputs.
NON_DIFFERENTIABLE: frozenset[str] = frozenset({"stop_gradient"})

#: call-like primitives whose inner jaxpr maps inputs to outputs one to one (inlined).
INLINED: frozenset[str] = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "remat",
        "checkpoint",
    }
)

#: a producer of a value: (node id, which of the node's forward outputs it is).
_Source = tuple[int, int]


@dataclass(frozen=True)
class JaxprGraph:
    """A backward graph read from a jaxpr, with what is needed to walk it.

    Attributes:
        graph: the backward graph; accumulator ``i`` holds parameter index ``i`` (plan order).
        roots: node ids of the outputs' backward nodes (where a backward pass starts).
        param_names: parameter names in index order.
    """

    graph: BackwardGraph
    roots: tuple[int, ...]
    param_names: tuple[str, ...]

    def dependencies(self) -> Dependencies:
        """Dependency counts, leaves and needed nodes from the roots."""
        return compute_dependencies(self.graph, self.roots)

    def unused(self) -> tuple[int, ...]:
        """Indices of the parameters the outputs do not depend on (DDP's search)."""
        return graph_unused_parameters(self.graph, self.roots, num_params=len(self.param_names))

    def unused_names(self) -> tuple[str, ...]:
        """Names of the unused parameters, in index order."""
        return tuple(self.param_names[i] for i in self.unused())


def _is_var(v: Any) -> bool:
    return not isinstance(v, Literal)


def _carries_gradient(v: Any) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def _inner(eqn: Any) -> Jaxpr | None:
    """The inner jaxpr of an inlinable call whose inputs and outputs match the equation's."""
    if eqn.primitive.name not in INLINED:
        return None
    for value in eqn.params.values():
        inner = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        if (
            isinstance(inner, Jaxpr)
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def _walk(jaxpr: Jaxpr, env: dict[Any, _Source], builder: GraphBuilder) -> None:
    """Add the backward nodes of ``jaxpr``'s equations; ``env`` maps vars to producers."""
    for eqn in jaxpr.eqns:
        inputs = [(k, env[v]) for k, v in enumerate(eqn.invars) if _is_var(v) and v in env]
        if not inputs or eqn.primitive.name in NON_DIFFERENTIABLE:
            continue
        inner = _inner(eqn)
        if inner is not None:
            inner_env = {
                iv: env[ov]
                for iv, ov in zip(inner.invars, eqn.invars, strict=True)
                if _is_var(ov) and ov in env
            }
            _walk(inner, inner_env, builder)
            for ov, iv in zip(eqn.outvars, inner.outvars, strict=True):
                if _is_var(iv) and iv in inner_env and _carries_gradient(ov):
                    env[ov] = inner_env[iv]
            continue
        outs = [k for k, v in enumerate(eqn.outvars) if _carries_gradient(v)]
        if not outs:
            continue
        node = builder.add_node("function", eqn.primitive.name)
        for _, (src, nr) in inputs:
            builder.add_edge(node, src, nr)
        for k in outs:
            env[eqn.outvars[k]] = (node, k)


def backward_graph(
    fn: Callable[..., Any], params: Any, *args: Any, names: Sequence[str] | None = None
) -> JaxprGraph:
    """The backward graph of ``fn(params, *args)`` with respect to ``params``' leaves.

    Args:
        fn: a JAX function whose first argument is the parameter pytree.
        params: the parameters (arrays or ``jax.ShapeDtypeStruct``; only shapes are used).
        args: the other arguments (they carry no gradient: inputs, targets).
        names: parameter names in index order (torch's ``named_parameters()`` order for a
            zoo model); default: the pytree's flattening order and dotted key paths.

    Returns:
        The graph, whose accumulators are numbered by parameter index, with its roots.
    """
    closed = jax.make_jaxpr(fn)(params, *args)
    jaxpr = closed.jaxpr
    order = plan_order(params, names)
    param_names = tuple(names) if names is not None else tuple(leaf_names(params))
    builder = GraphBuilder()
    env: dict[Any, _Source] = {}
    # Accumulators first: the engine runs higher ids first, and leaves finish a backward pass.
    for index, leaf in enumerate(order):
        var = jaxpr.invars[leaf]
        node = builder.add_node("accumulate", param_names[index], param=index)
        if _carries_gradient(var):
            env[var] = (node, 0)
    _walk(jaxpr, env, builder)
    roots = sorted({env[v][0] for v in jaxpr.outvars if _is_var(v) and v in env})
    return JaxprGraph(graph=builder.build(), roots=tuple(roots), param_names=param_names)


def find_unused_parameters(
    fn: Callable[..., Any], params: Any, *args: Any, names: Sequence[str] | None = None
) -> tuple[int, ...]:
    """Indices of the parameters that ``fn(params, *args)``'s outputs do not depend on.

    The same answer DDP's ``find_unused_parameters=True`` search gives on the torch twin of
    the model: walk the backward graph from the outputs and collect the parameters whose
    accumulator is never reached.
    """
    return backward_graph(fn, params, *args, names=names).unused()
