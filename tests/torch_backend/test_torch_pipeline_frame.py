"""A pipeline message's frame without processes: packed small, apart when large."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from xgrad.torch_backend.pipeline_edges import POISON  # noqa: E402
from xgrad.torch_backend.pipeline_frame import (  # noqa: E402
    HEADER_BYTES,
    NONE_BITS,
    PACK_LIMIT,
    Frame,
    frame_of,
    none_code,
    with_nones,
)


def test_small_leaves_travel_in_the_header_buffer_and_come_back_as_views() -> None:
    leaves = [torch.randn(3, 5), torch.arange(7), torch.tensor([True, False, True])]
    frame = Frame([(t.shape, t.dtype) for t in leaves], "cpu")
    assert frame.packed and frame.offsets[0] == HEADER_BYTES
    assert all(o % 16 == 0 for o in frame.offsets)
    sent = frame.pack(0, 4, leaves)
    assert len(sent) == 1 and sent[0].numel() == frame.total
    received = frame.buffers()
    received[0].copy_(sent[0])
    assert frame.header(received) == (0, 4)
    back = frame.leaves(received)
    for a, b in zip(back, leaves, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_large_leaves_go_apart_and_a_bare_header_is_sixteen_bytes() -> None:
    big = torch.zeros(PACK_LIMIT // 4 + 1)  # float32: just over the limit
    frame = Frame([(big.shape, big.dtype)], "cpu")
    assert not frame.packed and frame.total == HEADER_BYTES
    sent = frame.pack(0, 1, [big])
    assert len(sent) == 2 and sent[1].shape == big.shape
    assert [b.numel() for b in frame.buffers()] == [HEADER_BYTES, big.numel()]
    bare = Frame([], "cpu").pack(-1, -1, None)
    assert len(bare) == 1 and bare[0].numel() == HEADER_BYTES
    assert Frame([], "cpu").header(bare) == (-1, -1)
    # A changed description over a frame posted apart: header, then dummies for its leaves.
    changed = frame.pack(120, 2, None)
    assert changed[0].numel() == HEADER_BYTES and changed[1].shape == big.shape


def test_numpy_and_torch_writes_give_the_same_bytes_for_every_cpu_dtype() -> None:
    base = torch.randn(4, 6, dtype=torch.float64)
    leaves = [
        base.float().t(),  # not contiguous
        torch.randn(3, 2, requires_grad=True) * 2,  # part of a graph
        torch.tensor(2.5, dtype=torch.float64),  # zero-dimensional
        torch.randn(5, dtype=torch.complex64).conj(),  # a lazy conjugate
        torch.tensor([True, False, True]),
        torch.arange(-3, 4, dtype=torch.int16),
        torch.randn(3, dtype=torch.float16),
        torch.empty(0, 3),
    ]
    frame = Frame([(t.shape, t.dtype) for t in leaves], "cpu")
    plain = Frame([(t.shape, t.dtype) for t in leaves], torch.device("cpu"))
    plain._views = None  # the torch writes, as on other devices
    fast, slow = frame.pack(3, 7, leaves)[0], plain.pack(3, 7, leaves)[0]
    assert not fast.requires_grad and fast.shape == slow.shape
    # Header and leaves byte for byte (the alignment padding is never written).
    spans = [(0, HEADER_BYTES)] + [
        (o, o + t.numel() * t.element_size()) for o, t in zip(frame.offsets, leaves, strict=True)
    ]
    for a, b in spans:
        assert torch.equal(fast[a:b], slow[a:b])
    assert frame.header([slow]) == plain.header([fast]) == (3, 7)
    for a, b, t in zip(frame.leaves([slow]), plain.leaves([fast]), leaves, strict=True):
        assert a.dtype == b.dtype == t.dtype and a.shape == t.shape
        assert torch.equal(a, t.detach().resolve_conj()) and torch.equal(b, a)
    # A dtype NumPy lacks goes through torch.
    bf = torch.randn(2, 3).bfloat16()
    frame = Frame([(bf.shape, bf.dtype)], "cpu")
    assert frame._views is None
    back = frame.leaves(frame.pack(0, 1, [bf]))
    assert torch.equal(back[0], bf) and frame.header(frame.pack(5, 6, None)) == (5, 6)


def test_frames_are_made_once_per_layout_and_device() -> None:
    layout = [(torch.Size([2, 3]), torch.float32)]
    assert frame_of(layout, "cpu") is frame_of([((2, 3), torch.float32)], "cpu")
    assert frame_of(layout, "cpu") is not frame_of([(torch.Size([2, 4]), torch.float32)], "cpu")
    assert frame_of([], "cpu").total == HEADER_BYTES


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])  # NumPy and torch writes
def test_a_gradient_that_is_none_keeps_its_place_and_comes_back_none(dtype: torch.dtype) -> None:
    grads = [torch.randn(3, dtype=dtype), None, torch.zeros(2, 2, dtype=dtype), None]
    shapes = [(torch.Size([3]), dtype), (torch.Size([4]), dtype)] * 2
    shapes[2] = (torch.Size([2, 2]), dtype)
    code, leaves = none_code(grads, shapes, "cpu")
    assert code == 0b1010 and code != POISON and leaves == grads
    k = PACK_LIMIT // 16  # the same leaves repeated k times go apart: dummies for Nones
    apart = [(torch.Size([shape.numel() * k]), d) for shape, d in shapes]
    assert not Frame(apart, "cpu").packed
    for frame in (Frame(shapes, "cpu"), Frame(apart, "cpu")):
        if not frame.packed:
            leaves = [None if g is None else g.reshape(-1).repeat(k) for g in grads]
        sent = frame.pack(code, 3, leaves)
        received = frame.buffers()
        assert [t.numel() for t in sent] == [t.numel() for t in received]
        for a, b in zip(received, sent, strict=True):
            a.copy_(b)
        got_code, mb = frame.header(received)
        assert (got_code, mb) == (code, 3)
        back = with_nones(got_code, frame.leaves(received))
        assert [t is None for t in back] == [g is None for g in grads]
        for a, b in zip(back, leaves, strict=True):
            assert a is None or torch.equal(a, b)  # a computed zero stays zeros
    assert with_nones(0, [torch.ones(1)])[0] is not None


def test_a_none_past_the_bits_of_the_code_is_sent_as_zeros() -> None:
    shapes = [(torch.Size([1]), torch.float32)] * (NONE_BITS + 2)
    grads: list[torch.Tensor | None] = [None] * len(shapes)
    code, leaves = none_code(grads, shapes, "cpu")
    assert code == (1 << NONE_BITS) - 1 and code > 0
    assert all(g is None for g in leaves[:NONE_BITS])
    assert all(g is not None and torch.equal(g, torch.zeros(1)) for g in leaves[NONE_BITS:])
    back = with_nones(code, [torch.zeros(1)] * len(shapes))
    assert [g is None for g in back] == [True] * NONE_BITS + [False, False]
