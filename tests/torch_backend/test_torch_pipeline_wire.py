"""The pipeline's wire format without processes: pytrees described, rebuilt and split."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from xgrad.torch_backend.pipeline_wire import (  # noqa: E402
    Description,
    EdgeCache,
    carried,
    describe,
    detach_tree,
    differentiable,
    empty_leaves,
    mark_gradients,
    rebuild,
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


def test_repeated_description_costs_one_header() -> None:
    cache = EdgeCache()
    posted: list[Any] = []

    def post(t: Any) -> Any:
        posted.append(t)
        return None

    tree = (torch.randn(2, 2),)
    cache.send("e", tree, [False], post, "0SEND_F0", "cpu")
    assert [int(posted[0].item()), posted[1].dtype] == [posted[1].numel(), torch.uint8]
    posted.clear()
    cache.send("e", (torch.randn(2, 2),), [False], post, "0SEND_F1", "cpu")
    assert int(posted[0].item()) == 0 and len(posted) == 2  # header "same", then the leaf
    posted.clear()
    cache.send("e", (torch.randn(3, 2),), [False], post, "0SEND_F2", "cpu")  # a new shape
    assert int(posted[0].item()) > 0 and len(posted) == 3
    cache.clear()
    assert cache.last("e") is None


def test_split_batch_and_its_errors() -> None:
    parts = split_batch({"x": torch.arange(8).reshape(4, 2), "k": 1}, 2, "inputs", 0)
    assert [p["x"].shape[0] for p in parts] == [2, 2] and parts[1]["k"] == 1
    with pytest.raises(ValueError, match="rank 0: inputs batch size 5 is not a multiple of the 2"):
        split_batch(torch.zeros(5, 1), 2, "inputs", 0)
    with pytest.raises(ValueError, match="inputs leaf 1 batch size 3"):
        split_batch((torch.zeros(4), torch.zeros(3)), 2, "inputs", 0)
    with pytest.raises(TypeError, match="rank 1: targets must be a tensor or a pytree"):
        split_batch(None, 2, "targets", 1)
    with pytest.raises(TypeError, match="leaf 0 is a object"):
        describe((object(),), "0SEND_F0")
