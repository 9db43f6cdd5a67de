"""backward_graph with leaves that are not reduced parameters (inputs that require grad)."""

from __future__ import annotations

import torch

from xgrad.graph import NodeKind, compute_dependencies
from xgrad.torch_backend.autograd_graph import backward_graph


def test_an_input_that_requires_grad_is_a_leaf() -> None:
    torch.manual_seed(0)
    fc = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    out = fc(x).sum() + x.pow(2).sum()  # a gradient penalty's shape
    index = {id(fc.weight): 0, id(fc.bias): 1}
    graph, roots = backward_graph(out, index)
    deps = compute_dependencies(graph, roots)  # failed: "reached but has no outgoing edges"
    leaves = {int(graph.params[u]) for u in deps.leaves}
    assert leaves == {0, 1, 2}  # the weight, the bias, and x after them
    x_node = graph.accumulator(2)
    assert graph.kind(x_node) == NodeKind.ACCUMULATE
    # x is reached twice: through the linear layer and through the penalty.
    assert deps.table()[x_node] == 2
    assert all(bool(deps.needed[u]) for u in deps.leaves)


def test_an_ignored_parameter_is_still_a_leaf() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    graph, roots = backward_graph((a * b).sum(), {id(a): 0})
    deps = compute_dependencies(graph, roots)
    assert sorted(int(graph.params[u]) for u in deps.leaves) == [0, 1]
