"""A pipeline message's frame without processes: packed small, apart when large."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from xgrad.torch_backend.pipeline_frame import HEADER_BYTES, PACK_LIMIT, Frame, frame_of  # noqa: E402


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
