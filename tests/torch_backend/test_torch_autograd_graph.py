"""grad_fn graphs as xgrad graphs: structure, and unused parameters found as DDP finds them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from xgrad.dependencies import compute_dependencies, unused_parameters
from xgrad.graph import NodeKind
from xgrad.torch_backend.autograd_graph import (
    backward_graph,
    find_tensors,
    find_unused_parameters,
    grad_accumulators,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = self.b(h) * self.scale
        return out + self.spare(h) if use_spare else out


def _index(model: nn.Module) -> tuple[list[str], dict[int, int]]:
    names = [n for n, _ in model.named_parameters()]
    return names, {id(p): i for i, p in enumerate(model.parameters())}


def test_backward_graph_of_a_linear_layer() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    out = lin(torch.randn(5, 3)).sum()
    graph, roots = backward_graph(out, {id(lin.weight): 0, id(lin.bias): 1})
    assert [graph.name(r) for r in roots] == ["SumBackward0"]
    accumulators = {int(graph.params[u]) for u in graph.nodes_of_kind(NodeKind.ACCUMULATE)}
    assert accumulators == {0, 1}
    deps = compute_dependencies(graph, roots)
    # Every accumulator is a leaf reached exactly once; the walk covers the whole graph.
    assert all(deps.counts[graph.accumulator(i)] == 1 for i in (0, 1))
    assert bool(deps.reachable.all())


@pytest.mark.parametrize("use_spare", [False, True])
def test_fast_unused_search_equals_the_graph_computation(use_spare: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    names, index = _index(model)
    out = model(torch.randn(5, 3), use_spare)
    graph, roots = backward_graph(out, index)
    expected = unused_parameters(graph, roots, num_params=len(names))
    found = find_unused_parameters(out, index, len(names))
    assert found == expected
    assert [names[i] for i in found] == ([] if use_spare else ["spare.weight", "spare.bias"])


@pytest.mark.parametrize("use_spare", [False, True])
def test_held_accumulators_give_the_same_answer_pass_after_pass(use_spare: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    names, index = _index(model)
    params = list(model.parameters())
    accumulators = grad_accumulators(params)
    assert sorted(accumulators.values()) == list(range(len(params)))
    # Only some held: the others are recognised the old way (by their variable).
    some = {node: i for node, i in accumulators.items() if i % 2 == 0}
    for _ in range(3):  # every forward pass links the same (held) nodes
        out = model(torch.randn(5, 3), use_spare)
        expected = find_unused_parameters(out, index, len(names))
        assert find_unused_parameters(out, index, len(names), accumulators) == expected
        assert find_unused_parameters(out, index, len(names), some) == expected
        nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]  # type: ignore[union-attr]
        assert [accumulators.get(node) for node in nodes] == list(range(len(params)))


def test_unused_search_through_nested_outputs_and_parameters_as_outputs() -> None:
    @dataclasses.dataclass
    class Out:
        main: torch.Tensor
        extra: dict[str, object]

    torch.manual_seed(0)
    model = Net()
    names, index = _index(model)
    h = model.a(torch.randn(2, 3))
    out = Out(main=h, extra={"p": [model.scale, 3], "none": None})
    assert len(list(find_tensors(out))) == 2
    unused = [names[i] for i in find_unused_parameters(out, index, len(names))]
    assert unused == ["b.weight", "b.bias", "spare.weight", "spare.bias"]
    graph, roots = backward_graph(out, index)
    assert len(roots) == 2
    # The parameter that is itself an output has one accumulator, used twice at most.
    assert int((graph.params == names.index("scale")).sum()) == 1


def test_inputs_that_require_grad_are_not_parameters() -> None:
    torch.manual_seed(0)
    model = Net()
    names, index = _index(model)
    x = torch.randn(2, 3, requires_grad=True)
    out = model(x)
    graph, _ = backward_graph(out, index)
    assert graph.num_nodes > 0
    unused = [names[i] for i in find_unused_parameters(out, index, len(names))]
    assert unused == ["spare.weight", "spare.bias"]


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
