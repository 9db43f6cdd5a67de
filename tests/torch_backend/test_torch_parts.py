"""The in-process parts of the torch backend: graph walk, array ops, model checks, waits."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

import xgrad.torch_backend as tb
from xgrad.graph import NodeKind, compute_dependencies, unused_parameters
from xgrad.torch_backend.autograd_graph import backward_graph, find_tensors, find_unused_parameters
from xgrad.torch_backend.comm import FutureWork
from xgrad.torch_backend.ops import TorchArrayOps
from xgrad.torch_backend.sync import describe_params, first_mismatch


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


def test_ops_copy_scale_and_views() -> None:
    ops = TorchArrayOps()
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    flat = ops.new_flat([a, b], 10)
    assert flat.shape == (10,) and flat.dtype == torch.float32 and not flat.any()
    ops.copy_to(ops.view(flat, 0, a), a, 0.5)
    ops.copy_to(ops.view(flat, 6, b), b)
    assert flat.tolist() == [0, 0.5, 1, 1.5, 2, 2.5, 0, 1, 2, 3]
    view = ops.view(flat, 6, b)
    assert ops.is_view_of(view, ops.view(flat, 6, b))
    assert not ops.is_view_of(b, view)
    ops.div_(view, 2)
    assert flat[6:].tolist() == [0, 0.5, 1, 1.5]
    ops.copy_to(flat, torch.ones(10))
    assert flat.tolist() == [1.0] * 10
    assert ops.nbytes(a) == 24 and ops.key(a) == (torch.float32, torch.device("cpu"))
    np.testing.assert_array_equal(ops.to_numpy(ops.from_numpy(np.arange(3), flat)), [0, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ops_scaled_copy_rounds_like_pytorchs_reducer(dtype: torch.dtype) -> None:
    """PyTorch's reducer multiplies by a wrapped double ``1 / world_size`` while copying."""
    torch.manual_seed(0)
    ops = TorchArrayOps()
    g = torch.randn(50).to(dtype)
    flat = torch.zeros(50, dtype=dtype)
    ops.copy_to(flat, g, 1 / 3)
    assert torch.equal(flat, g * (1 / 3))


def test_first_mismatch_names_rank_and_parameter() -> None:
    p = [torch.zeros(2, 3), torch.zeros(3)]
    same = describe_params(["w", "b"], p)
    assert first_mismatch([same, same]) is None
    other = describe_params(["w", "b"], [torch.zeros(2, 3), torch.zeros(4)])
    assert first_mismatch([same, same, other]) == (
        "parameter 1 differs: rank 2 has 'b' with shape [4] and dtype float32, "
        "rank 0 has 'b' with shape [3] and dtype float32"
    )
    wrong_dtype = describe_params(["w", "b"], [torch.zeros(2, 3, dtype=torch.float64), p[1]])
    assert "dtype float64" in str(first_mismatch([same, wrong_dtype]))
    fewer = describe_params(["w"], p[:1])
    message = first_mismatch([same, fewer])
    assert message is not None
    assert message.startswith("rank 1 has 1 parameters to reduce but rank 0 has 2")
    assert "only rank 0 has is 1" in message


def test_future_work_waits_with_a_bound() -> None:
    done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    done.set_result([torch.ones(2)])
    assert FutureWork(done, 1.0).wait().tolist() == [1.0, 1.0]
    never: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"comm hook x on bucket 0 did not complete within 0\.2 s"
    ):
        FutureWork(never, 0.2, name="comm hook x on bucket 0").wait()
    assert time.monotonic() - start < 5


def test_package_is_lazy_and_available() -> None:
    assert tb.available()
    assert tb.DistributedDataParallel.__name__ == "DistributedDataParallel"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tb.nope


def test_ddp_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        tb.DistributedDataParallel(nn.Linear(2, 2))
