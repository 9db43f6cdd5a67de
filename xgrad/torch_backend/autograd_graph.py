"""PyTorch's ``grad_fn`` graph as xgrad's ``BackwardGraph``, and DDP's unused-parameter search."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from xgrad.graph import BackwardGraph, NodeKind

__all__ = [
    "backward_graph",
    "find_tensors",
    "find_unused_parameters",
    "grad_accumulators",
    "leaf_variables",
]

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
_FUNCTION = int(NodeKind.FUNCTION)
_ACCUMULATE = int(NodeKind.ACCUMULATE)


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward output: nested lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, f.name))


def backward_graph(outputs: Any, param_index: Mapping[int, int]) -> tuple[BackwardGraph, list[int]]:
    """Walk the ``grad_fn`` graph behind ``outputs`` into a :class:`BackwardGraph`.

    Args:
        outputs: a forward output (any nesting :func:`find_tensors` understands).
        param_index: ``id(parameter) -> index`` for the parameters being reduced. Their
            ``AccumulateGrad`` nodes become accumulators with that index. Other leaves
            that require grad (an input of a gradient penalty, an ignored parameter) are
            still leaves: their accumulators get the indices after the reduced ones
            (``max(param_index) + 1``, ... in discovery order), so a backward that also
            differentiates an input is a valid graph.

    Returns:
        The graph (node ids in discovery order, names the ``grad_fn`` class names) and the
        node ids of the outputs' own ``grad_fn`` (the roots).
    """
    ids: dict[int, int] = {}
    kinds: list[int] = []
    params: list[int] = []
    names: list[str] = []
    src: list[int] = []
    dst: list[int] = []
    input_nr: list[int] = []
    stack: list[Any] = []
    # Every node seen stays referenced until the walk ends: ids of freed Python wrappers
    # could be reused by other nodes.
    keep: list[Any] = []
    by_param: dict[int, int] = {}
    others = itertools.count(max(param_index.values(), default=-1) + 1)

    def node_of(fn: Any) -> int:
        """The node id of ``fn``, adding it when new."""
        key = id(fn)
        found = ids.get(key)
        if found is not None:
            return found
        keep.append(fn)
        if type(fn) is _ACCUMULATE_GRAD:
            index = param_index.get(id(fn.variable))
            if index is None:
                index = next(others)
            if index in by_param:  # the parameter is also an output itself
                ids[key] = by_param[index]
                return ids[key]
            by_param[index] = len(kinds)
            kinds.append(_ACCUMULATE)
            params.append(index)
        else:
            kinds.append(_FUNCTION)
            params.append(-1)
            stack.append(fn)
        names.append(type(fn).__name__)
        ids[key] = len(kinds) - 1
        return ids[key]

    roots: list[int] = []
    for t in find_tensors(outputs):
        fn = t.grad_fn
        if fn is not None:
            roots.append(node_of(fn))
        elif t.requires_grad and id(t) in param_index:
            # The output is a parameter itself: its accumulator is a root.
            index = param_index[id(t)]
            if index not in by_param:
                by_param[index] = len(kinds)
                kinds.append(_ACCUMULATE)
                params.append(index)
                names.append("AccumulateGrad")
            roots.append(by_param[index])
    while stack:
        fn = stack.pop()
        u = ids[id(fn)]
        for child, nr in fn.next_functions:
            if child is None:
                continue
            src.append(u)
            dst.append(node_of(child))
            input_nr.append(nr)
    graph = BackwardGraph.from_arrays(
        kinds, src, dst, input_nr=input_nr, params=params, names=names
    )
    return graph, roots


def grad_accumulators(params: Sequence[torch.Tensor]) -> dict[Any, int]:
    """Each parameter's ``AccumulateGrad`` node -> its index, for :func:`find_unused_parameters`.

    A parameter's accumulator lives while something holds it (PyTorch's reducer holds
    them too): the caller keeps this dict, so every forward pass links the same node
    objects and the walk recognises a parameter by one dict lookup.
    """
    with torch.enable_grad():
        return {
            p.view_as(p).grad_fn.next_functions[0][0]: i  # type: ignore[union-attr]
            for i, p in enumerate(params)
            if p.requires_grad
        }


def find_unused_parameters(
    outputs: Any,
    param_index: Mapping[int, int],
    num_params: int,
    accumulators: Mapping[Any, int] | None = None,
) -> tuple[int, ...]:
    """Indices of the parameters that took no part in computing ``outputs`` (sorted).

    DDP's search, run at the end of every forward pass with ``find_unused_parameters``:
    walk the graph from the outputs; a parameter whose accumulator is not reached gets no
    gradient in this backward pass. The answer is
    ``xgrad.graph.unused_parameters(*backward_graph(outputs, param_index))``, computed
    without materialising the graph: building a ``BackwardGraph`` costs about half a
    millisecond more per forward pass (array validation, a sparse-matrix walk), which
    is the whole time budget of a small model's step; the tests check the two agree.

    ``accumulators`` (from :func:`grad_accumulators`, held by the caller): the nodes of
    the parameters, found by a dict lookup as the walk meets them, never pushed; about
    15% faster on 1,000 parameters. A node not in it is looked at as before.
    """
    acc = accumulators if accumulators is not None else {}
    used = bytearray(num_params)
    # The nodes themselves (hashed by identity), not their ids: one call less per edge,
    # and every node seen stays referenced until the walk ends. About 20% faster.
    seen: set[Any] = set()
    stack: list[Any] = []
    for t in find_tensors(outputs):
        fn = t.grad_fn
        if fn is None:
            index = param_index.get(id(t))
            if index is not None:
                used[index] = 1
        elif fn not in seen:
            seen.add(fn)
            stack.append(fn)
    found = sum(used)
    pop, push, add, known = stack.pop, stack.append, seen.add, acc.get
    while stack and found < num_params:  # every parameter reached: the rest cannot add one
        fn = pop()
        # A type check, not getattr(fn, "variable", None): a failed getattr on an autograd
        # node raises and catches an AttributeError, the slowest step of this loop.
        if type(fn) is _ACCUMULATE_GRAD:
            index = param_index.get(id(fn.variable))
            if index is not None and not used[index]:
                used[index] = 1
                found += 1
            continue
        for child, _ in fn.next_functions:
            if child is None or child in seen:
                continue
            add(child)
            index = known(child)
            if index is None:
                push(child)  # a function, or an accumulator not in ``accumulators``
            elif not used[index]:
                used[index] = 1
                found += 1
    return tuple(i for i in range(num_params) if not used[i])


def leaf_variables(roots: Iterable[Any], stops: Collection[Any] = ()) -> list[torch.Tensor]:
    """The leaves (``AccumulateGrad`` nodes' variables) that the ``grad_fn`` nodes ``roots``
    reach, in the order a depth-first walk meets them, never walking into a node of
    ``stops``: the pipeline's searches for what a loss reads of its own and for what the
    step's inputs were computed from, which want every leaf, not parameters by index."""
    seen: set[Any] = set()
    todo: list[Any] = []
    for root in roots:
        if root is not None and root not in seen and root not in stops:
            seen.add(root)
            todo.append(root)
    leaves = []
    while todo:
        node = todo.pop()
        if type(node) is _ACCUMULATE_GRAD:  # (not getattr: see find_unused_parameters)
            leaves.append(node.variable)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen and child not in stops:
                seen.add(child)
                todo.append(child)
    return leaves
