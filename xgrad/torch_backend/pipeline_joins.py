"""A weight pass (W) that starts where the parameters join the input's gradient chain.

Why: a stage's W pass run as ``backward(outputs, inputs=params)`` recomputes the whole
chain of activation gradients from the output down, which its I pass has already computed.
PyTorch's zero-bubble runtime records, during the I pass, the gradient flowing into each
*join* (a node that depends on the stage's input and has a branch leading to parameters
only), and runs W from the joins. This module does the same with two differences that make
it cheap per microbatch:

* the joins' gradients are captured by the I pass's own ``autograd.grad`` call (the joins
  are extra ``GradientEdge`` inputs of it), with no hooks to register and remove;
* the graph is walked in full once per stage and step (:func:`analyse`); every other
  microbatch only follows the recorded paths from the output to the joins, the stage's
  inputs and the parameters (:meth:`JoinPlan.follow`), checking each node's type, its
  creation order relative to the root (``_sequence_nr``), the edges of the joins and of
  every node under their parameter branches, and that the accumulators are those of the
  same inputs and parameters, and walks in full again on any mismatch.

W is one ``backward`` per group of joins sharing parameters, from the joins' edges with
``inputs=params``: parameters' ``AccumulateGrad`` nodes run, so their hooks (DDP, REDUCE_GRAD
bookkeeping) run as in the plain W pass. Graphs this cannot handle exactly (an output that
does not depend on the input, joins nested on one chain that share a parameter, no joins)
get no plan, and the caller runs the plain W pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["Captured", "JoinPlan", "StageJoins", "analyse", "run_weight"]


#: which of a node's ``next_functions`` are not ``None`` (``None``: not checked)
Edges = tuple[bool, ...] | None


def _edges(node: Any) -> tuple[bool, ...]:
    return tuple(f is not None for f, _ in node.next_functions)


@dataclass(frozen=True)
class JoinPlan:
    """Where one stage graph's joins are, as paths from its roots (the outputs' nodes).

    ``program`` rebuilds the nodes on those paths: entry ``i`` is ``(parent, index, type,
    offset, edges)``, node ``roots + i`` being ``nodes[parent].next_functions[index][0]``,
    of that ``type``, created ``offset`` nodes before the first root (``None`` for
    accumulators), with ``edges`` (which of its ``next_functions`` are not ``None``; ``None``:
    not checked; checked on the joins and every node under their parameter branches, all of
    which are in the program).
    """

    roots: tuple[tuple[type, Edges], ...]  # the roots' node types and edges
    params: tuple[torch.Tensor, ...]  # the stage's parameters the positions below refer to
    program: tuple[tuple[int, int, type, int | None, Edges], ...]
    inputs: tuple[tuple[int, int], ...]  # (node, input position): the input's accumulator
    leaves: tuple[tuple[int, int], ...]  # (node, param position): the parameter's accumulator
    edges: tuple[tuple[int, int], ...]  # (node, gradient slot) captured by the I pass
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (edges, param positions)

    def follow(self, roots: list[Any], inputs: list[torch.Tensor]) -> list[Any] | None:
        """The joins' edges in this graph, or ``None`` where it differs from the plan's."""
        nodes: list[Any] = list(roots)
        nexts: list[Any] = [r.next_functions for r in roots]  # each node's, fetched once
        for nf, (kind, count), root in zip(nexts, self.roots, roots, strict=True):
            if count is not None and tuple(f is not None for f, _ in nf) != count:
                return None
            if type(root) is not kind:
                return None
        base = roots[0]._sequence_nr()
        try:
            for parent, index, kind, offset, count in self.program:
                node: Any = nexts[parent][index][0]
                if offset is None:  # an accumulator: no edges
                    nodes.append(node)
                    nexts.append(())
                    if type(node) is not kind:
                        return None
                    continue
                if base - node._sequence_nr() != offset:
                    return None
                nf = node.next_functions
                if count is not None and tuple(f is not None for f, _ in nf) != count:
                    return None
                if type(node) is not kind:
                    return None
                nodes.append(node)
                nexts.append(nf)
        except IndexError:
            return None
        for at, position in self.inputs:
            if nodes[at].variable is not inputs[position]:
                return None
        for at, position in self.leaves:  # the joins lead to the same parameters
            if nodes[at].variable is not self.params[position]:
                return None
        return [GradientEdge(nodes[at], slot) for at, slot in self.edges]


@dataclass
class Captured:
    """What the I pass leaves for W: the joins' edges and the gradients flowing into them."""

    plan: JoinPlan
    edges: list[Any]
    grads: list[torch.Tensor | None]


def analyse(roots: list[Any], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> Any:
    """Walk the graph from ``roots``; the plan of its joins, or ``None`` if W from the joins
    would not give exactly the plain W pass's gradients."""
    if not roots or not inputs or not params or any(r is None for r in roots):
        return None
    if len(set(roots)) < len(roots):
        return None  # outputs of one multi-output node (each root is a node of its own here)
    input_at = {id(t): i for i, t in enumerate(inputs)}
    param_at = {id(t): i for i, t in enumerate(params)}
    order: list[Any] = []  # every node, parents first (discovery order)
    index: dict[Any, int] = {}
    parent: list[tuple[int, int] | None] = []
    children: list[list[int]] = []
    for r in roots:
        if r not in index:
            index[r] = len(order)
            order.append(r)
            parent.append(None)
            children.append([])
    stack = list(range(len(order)))
    while stack:
        at = stack.pop()
        for slot, (nxt, _) in enumerate(order[at].next_functions):
            if nxt is None:
                continue
            found = index.get(nxt)
            if found is None:
                found = index[nxt] = len(order)
                order.append(nxt)
                parent.append((at, slot))
                children.append([])
                stack.append(found)
            children[at].append(found)
    # Per node: reaches an input (depends on it) and the parameters it reaches (bit set).
    dep = [False] * len(order)
    reach = [0] * len(order)
    leaf_input: dict[int, int] = {}
    leaf_param: dict[int, int] = {}
    done = [False] * len(order)
    for start in range(len(order)):
        stack = [start]
        while stack:
            at = stack[-1]
            if done[at]:
                stack.pop()
                continue
            todo = [c for c in children[at] if not done[c]]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            done[at] = True
            var = getattr(order[at], "variable", None)
            if var is not None:
                if id(var) in input_at:
                    dep[at] = True
                    leaf_input[at] = input_at[id(var)]
                elif id(var) in param_at:
                    reach[at] = 1 << param_at[id(var)]
                    leaf_param[at] = param_at[id(var)]
                continue
            dep[at] = any(dep[c] for c in children[at])
            for c in children[at]:
                reach[at] |= reach[c]
    if not all(dep[i] for i in range(len(roots))) or len(leaf_input) < len(set(input_at.values())):
        return None
    joins = {}  # node -> the parameters its input-free branches reach
    for at, kids in enumerate(children):
        if dep[at]:
            bits = 0
            for c in kids:
                if not dep[c]:
                    bits |= reach[c]
            if bits:
                joins[at] = bits
    if not joins:
        return None
    groups = _groups(joins)
    for members in groups:
        if len(members) > 1 and _nested(members, children, dep):
            return None
    # Every node under the joins' parameter branches is followed and its edges counted.
    branch: set[int] = set()
    stack = [c for at in joins for c in children[at] if not dep[c]]
    while stack:
        at = stack.pop()
        if at not in branch:
            branch.add(at)
            stack.extend(children[at])
    counted = branch | set(joins)
    needed = counted | set(leaf_input) | set(leaf_param)
    for at in list(needed):
        while parent[at] is not None:
            at = parent[at][0]  # type: ignore[index]
            if at in needed:
                break
            needed.add(at)
    slot_of = {i: i for i in range(len(roots))}
    program: list[tuple[int, int, type, int | None, Edges]] = []
    base = roots[0]._sequence_nr()
    for at in range(len(roots), len(order)):
        if at in needed:
            up, slot = parent[at]  # type: ignore[misc]
            node = order[at]
            offset = None if hasattr(node, "variable") else base - node._sequence_nr()
            count = _edges(node) if at in counted and offset is not None else None
            slot_of[at] = len(roots) + len(program)
            program.append((slot_of[up], slot, type(node), offset, count))
    edges: list[tuple[int, int]] = []
    plan_groups = []
    for members in groups:
        ids = []
        bits = 0
        for at in members:
            for k in range(len(order[at]._input_metadata)):
                ids.append(len(edges))
                edges.append((slot_of[at], k))
            bits |= joins[at]
        params_in = tuple(i for i in range(len(params)) if bits >> i & 1)
        plan_groups.append((tuple(ids), params_in))
    return JoinPlan(
        roots=tuple((type(r), _edges(r) if i in counted else None) for i, r in enumerate(roots)),
        params=tuple(params),
        program=tuple(program),
        inputs=tuple((slot_of[at], i) for at, i in sorted(leaf_input.items())),
        leaves=tuple((slot_of[at], i) for at, i in sorted(leaf_param.items())),
        edges=tuple(edges),
        groups=tuple(plan_groups),
    )


def _groups(joins: dict[int, int]) -> list[list[int]]:
    """Joins in groups that share a parameter (transitively), in node order."""
    groups: list[tuple[int, list[int]]] = []
    for at, bits in joins.items():
        merged = [at]
        keep = []
        for gbits, members in groups:
            if gbits & bits:
                bits |= gbits
                merged += members
            else:
                keep.append((gbits, members))
        groups = [*keep, (bits, sorted(merged))]
    return [members for _, members in groups]


def _nested(members: list[int], children: list[list[int]], dep: list[bool]) -> bool:
    """Whether a join of the group lies under another on the input's chain (W from both
    would count the lower one's gradient twice)."""
    targets = set(members)
    for start in members:
        seen = {start}
        stack = [c for c in children[start] if dep[c]]
        while stack:
            at = stack.pop()
            if at in targets:
                return True
            if at in seen:
                continue
            seen.add(at)
            stack.extend(c for c in children[at] if dep[c])
    return False


class StageJoins:
    """Per stage and its roots' types, the plan found by the last full walk; the runtime
    makes a new one each step."""

    def __init__(self) -> None:
        self.plans: dict[Any, JoinPlan | None] = {}

    def edges(
        self,
        stage: int,
        outs: list[Any],
        inputs: list[torch.Tensor],
        params: Callable[[], list[torch.Tensor]],
    ) -> tuple[JoinPlan, list[Any]] | None:
        """The plan and this graph's joins' edges, or ``None`` (run the plain W pass).
        ``outs`` are the stage's output tensors or their gradient edges.
        ``params()`` lists the stage's parameters; it is called only for a full walk."""
        roots = [o.grad_fn if isinstance(o, torch.Tensor) else o.node for o in outs]
        if None in roots:
            return None
        key = (stage, *map(type, roots))
        if key in self.plans:
            plan = self.plans[key]
            if plan is None:
                return None  # walked in full this step: no plan for this graph
            found = plan.follow(roots, inputs)
            if found is not None:
                return plan, found
        plan = analyse(roots, inputs, params())
        self.plans[key] = plan
        if plan is None:
            return None
        found = plan.follow(roots, inputs)
        return None if found is None else (plan, found)


def run_weight(captured: Captured) -> None:
    """W from the joins: one backward per group of joins sharing parameters."""
    for ids, positions in captured.plan.groups:
        edges = [captured.edges[i] for i in ids if captured.grads[i] is not None]
        if not edges:
            continue
        grads = [captured.grads[i] for i in ids if captured.grads[i] is not None]
        torch.autograd.backward(edges, grads, inputs=[captured.plan.params[i] for i in positions])
