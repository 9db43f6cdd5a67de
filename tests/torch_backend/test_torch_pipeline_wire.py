"""The pipeline's wire format without processes: pytrees described, rebuilt and split."""

from __future__ import annotations

import collections
import sys
import types
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")

from torch.utils import _pytree as pytree  # noqa: E402

from xgrad.torch_backend.pipeline_wire import (  # noqa: E402
    Description,
    EdgeCache,
    carried,
    describe,
    detach_tree,
    differentiable,
    empty_leaves,
    layout,
    mark_gradients,
    rebuild,
    spec_of,
    spec_text,
    split_batch,
)


def _tree() -> Any:
    h = torch.randn(2, 3, requires_grad=True) * 2
    return {"h": h, "mask": torch.tensor([1, 0]), "scale": torch.tensor(0.5), "n": 3, "s": None}


def test_description_round_trips_through_bytes_and_rebuilds() -> None:
    tree = _tree()
    description, tensors = describe(tree, "0SEND_F0")
    assert [leaf[0] for leaf in description.leaves] == ["t", "t", "t", "c", "c"]
    assert Description.from_bytes(description.to_bytes()) == description
    assert description.gradient_shapes == [((2, 3), torch.float32)]
    buffers = empty_leaves(description, "cpu")
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t.detach())
    mark_gradients(description, buffers)
    back = rebuild(description, buffers)
    assert back["n"] == 3 and back["s"] is None
    assert back["h"].requires_grad and not back["mask"].requires_grad
    assert torch.equal(back["h"], tree["h"].detach())


def test_checkpointed_outputs_carry_gradients_and_detach_marks_them() -> None:
    with torch.no_grad():
        out = (torch.randn(2) * 3, torch.tensor([1, 2]))
    assert carried(out, graph=False) == [True, False]  # recomputed later with a graph
    assert carried(out, graph=True) == [False, False]
    cut = detach_tree(out, [True, False])
    assert cut[0].requires_grad and not cut[1].requires_grad
    assert differentiable(cut) == [cut[0]]


def test_edge_cache_reuses_a_description_and_remembers_the_last() -> None:
    cache = EdgeCache()
    first, tensors = cache.describe("e", (torch.randn(2, 2),), [False], "0SEND_F0")
    again, _ = cache.describe("e", (torch.randn(2, 2),), [False], "0SEND_F1")
    assert again is first and len(tensors) == 1  # same structure and layout: not redone
    other, _ = cache.describe("e", (torch.randn(3, 2),), [False], "0SEND_F2")  # a new shape
    assert other != first and layout(other) == [(torch.Size([3, 2]), torch.float32)]
    assert cache.last("e") is None
    cache.remember("e", other)
    assert cache.last("e") == other
    cache.clear()
    assert cache.last("e") is None


def test_split_batch_and_its_errors() -> None:
    parts = split_batch({"x": torch.arange(8).reshape(4, 2), "k": 1}, 2, "inputs", 0)
    assert [p["x"].shape[0] for p in parts] == [2, 2] and parts[1]["k"] == 1
    # m that does not divide the batch: torch's tensor_split, the larger microbatches first
    parts = split_batch(torch.arange(5), 2, "inputs", 0)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="rank 0: inputs batch size 1 is smaller than the 2"):
        split_batch(torch.zeros(1, 1), 2, "inputs", 0)
    with pytest.raises(ValueError, match="inputs leaf 1 batch size 3 is smaller than the 4"):
        split_batch((torch.zeros(4), torch.zeros(3)), 4, "inputs", 0)
    # A 0-dim leaf has no batch dimension (it was said to have "batch size 0", which is
    # a multiple of every m).
    with pytest.raises(ValueError, match="inputs leaf 1 is a 0-dim tensor: it has no batch"):
        split_batch({"x": torch.zeros(4), "t": torch.tensor(0.5)}, 2, "inputs", 0)
    with pytest.raises(TypeError, match="rank 1: targets must be a tensor or a pytree"):
        split_batch(None, 2, "targets", 1)
    with pytest.raises(TypeError, match="leaf 0 is a object"):
        describe((object(),), "0SEND_F0")


class Pair(NamedTuple):
    """A stage's named-tuple output (module level: the receiving rank imports it)."""

    h: Any
    mask: Any


class _Box:
    """A pytree node class registered without a ``serialized_type_name``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


torch.utils._pytree.register_pytree_node(
    _Box, lambda b: ([b.inner], None), lambda leaves, _: _Box(leaves[0])
)


def test_named_tuples_and_unnamed_node_classes_cross_the_wire() -> None:
    # torch's treespec_dumps cannot name either (it asked for a private registration).
    tree = {"p": Pair(torch.ones(2), torch.tensor([1, 0])), "b": _Box(torch.zeros(1)), "n": 2}
    description, tensors = describe(tree, "0SEND_F0")
    assert description.spec.startswith("pickle:")
    back = rebuild(Description.from_bytes(description.to_bytes()), tensors)
    assert isinstance(back["p"], Pair) and back["p"].h is tensors[0]
    assert isinstance(back["b"], _Box) and back["n"] == 2
    plain = describe({"t": (torch.ones(1), [None])}, "0SEND_F0")[0]
    assert not plain.spec.startswith("pickle:")  # torch's JSON where it can


def test_a_class_another_rank_cannot_import_is_named() -> None:
    local = collections.namedtuple("local", "a")  # type: ignore[misc]  # made in a function
    local.__qualname__ = "nowhere.local"
    with pytest.raises(TypeError, match=r"define a named tuple .* at module level"):
        describe(local(torch.ones(1)), "0SEND_F0")
    gone = types.ModuleType("xgrad_test_gone")
    gone.Gone = collections.namedtuple("Gone", "a")  # type: ignore[attr-defined]
    gone.Gone.__module__ = "xgrad_test_gone"
    sys.modules["xgrad_test_gone"] = gone
    try:
        text = spec_text(pytree.tree_flatten(gone.Gone(torch.ones(1)))[1])
    finally:
        del sys.modules["xgrad_test_gone"]
    with pytest.raises(TypeError, match=r"this rank cannot import .*xgrad_test_gone"):
        spec_of(text)
