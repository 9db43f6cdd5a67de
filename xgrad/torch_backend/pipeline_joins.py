"""A weight pass (W) that starts where the parameters join the input's gradient chain.

Why: a stage's W pass run as ``backward(outputs, inputs=params)`` recomputes the whole
chain of activation gradients from the output down, which its I pass has already computed.
PyTorch's zero-bubble runtime records, during the I pass, the gradient flowing into each
*join* (a node that depends on the stage's input and has a branch leading to parameters
only), and runs W from the joins. This module does the same with two differences that make
it cheap per microbatch:

* the joins' gradients are captured by the I pass's own ``autograd.grad`` call (the joins
  are extra ``GradientEdge`` inputs of it), with no hooks to register and remove;
* the graph is analysed once per stage and step (:func:`analyse`); every other microbatch
  only checks that its graph is the same graph (:meth:`JoinPlan.follow`): a breadth-first
  walk comparing every node's type and every edge with the recorded ones, and that the
  accumulators are those of the same inputs and parameters. Any difference (a node that
  gains a parameter on some microbatches, a node shared or no longer shared) analyses again.

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


#: one node of a plan: its type and, per ``next_functions`` slot, the index of the node it
#: leads to (``-1``: ``None``); nodes are numbered in breadth-first discovery order
Shape = tuple[type, tuple[int, ...]]


@dataclass(frozen=True)
class JoinPlan:
    """One stage graph's joins, found by a full walk, and the whole graph they were found in.

    ``nodes`` is every node reachable from the roots (the outputs' nodes, numbered first),
    in breadth-first discovery order, as its type and where each of its edges leads. A later
    graph gets the same plan only if it is the same graph up to the node objects: the same
    types, every edge to the same numbered node (so a node reached twice is the same object
    both times), the joins with as many gradient slots, and every accumulator that of the same
    input or parameter, or of neither. That is everything :func:`analyse` reads, so it would
    find the same joins in it.
    """

    roots: int  # how many roots (nodes 0 .. roots - 1)
    inputs: int  # how many inputs
    nodes: tuple[Shape, ...]
    params: tuple[torch.Tensor, ...]  # the stage's parameters the positions below refer to
    roles: tuple[tuple[int, int, int], ...]  # (node, role, position) of every accumulator:
    # role 0 an input, 1 a parameter, 2 neither
    joins: tuple[tuple[int, int], ...]  # (node, gradient slots)
    edges: tuple[tuple[int, int], ...]  # (node, gradient slot) captured by the I pass
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (edges, param positions)

    def follow(self, roots: list[Any], inputs: list[torch.Tensor]) -> list[Any] | None:
        """The joins' edges in this graph, or ``None`` where it differs from the plan's."""
        plan = self.nodes
        if len(roots) != self.roots or len(inputs) != self.inputs:
            return None
        nodes: list[Any] = list(roots)
        at = 0
        try:
            while at < len(nodes):
                node: Any = nodes[at]
                kind, kids = plan[at]
                nf = node.next_functions
                if type(node) is not kind or len(nf) != len(kids):
                    return None
                for (child, _), want in zip(nf, kids, strict=True):
                    if want < 0:
                        if child is not None:
                            return None
                    elif want == len(nodes) and child is not None:
                        nodes.append(child)
                    elif nodes[want] is not child:
                        return None
                at += 1
        except IndexError:  # an edge to a node numbered past the plan's
            return None
        if len(nodes) != len(plan) or len(set(nodes)) != len(nodes):
            return None  # a node reached twice here that the plan had as two
        for at, role, position in self.roles:
            var = nodes[at].variable
            if role == 0:
                if var is not inputs[position]:
                    return None
            elif role == 1:
                if var is not self.params[position]:
                    return None
            elif any(var is t for t in inputs) or any(var is p for p in self.params):
                return None
        for at, slots in self.joins:
            if len(nodes[at]._input_metadata) != slots:
                return None
        return [GradientEdge(nodes[at], slot) for at, slot in self.edges]


@dataclass
class Captured:
    """What the I pass leaves for W: the joins' edges and the gradients flowing into them."""

    plan: JoinPlan
    edges: list[Any]
    grads: list[torch.Tensor | None]
    keep: bool = False  # W keeps the graph: the microbatches share a part made before


def analyse(roots: list[Any], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> Any:
    """Walk the graph from ``roots``; the plan of its joins, or ``None`` if W from the joins
    would not give exactly the plain W pass's gradients."""
    if not roots or not inputs or not params or any(r is None for r in roots):
        return None
    if len(set(roots)) < len(roots):
        return None  # outputs of one multi-output node (each root is a node of its own here)
    input_at = {id(t): i for i, t in enumerate(inputs)}
    param_at = {id(t): i for i, t in enumerate(params)}
    order: list[Any] = list(roots)  # every node, breadth-first (discovery order)
    index: dict[Any, int] = {r: i for i, r in enumerate(roots)}
    shapes: list[Shape] = []  # per node, its type and where each edge leads (-1: None)
    at = 0
    while at < len(order):
        kids = []
        for nxt, _ in order[at].next_functions:
            if nxt is None:
                kids.append(-1)
                continue
            found = index.get(nxt)
            if found is None:
                found = index[nxt] = len(order)
                order.append(nxt)
            kids.append(found)
        shapes.append((type(order[at]), tuple(kids)))
        at += 1
    children = [[k for k in kids if k >= 0] for _, kids in shapes]
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
    edges: list[tuple[int, int]] = []
    plan_groups = []
    for members in groups:
        ids = []
        bits = 0
        for at in members:
            for k in range(len(order[at]._input_metadata)):
                ids.append(len(edges))
                edges.append((at, k))
            bits |= joins[at]
        params_in = tuple(i for i in range(len(params)) if bits >> i & 1)
        plan_groups.append((tuple(ids), params_in))
    roles = []
    for at, node in enumerate(order):
        if hasattr(node, "variable"):
            if at in leaf_input:
                roles.append((at, 0, leaf_input[at]))
            elif at in leaf_param:
                roles.append((at, 1, leaf_param[at]))
            else:
                roles.append((at, 2, -1))
    return JoinPlan(
        roots=len(roots),
        inputs=len(inputs),
        nodes=tuple(shapes),
        params=tuple(params),
        roles=tuple(roles),
        joins=tuple((at, len(order[at]._input_metadata)) for at in joins),
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
        params = [captured.plan.params[i] for i in positions]
        torch.autograd.backward(edges, grads, inputs=params, retain_graph=captured.keep)
