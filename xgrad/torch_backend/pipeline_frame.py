"""How one pipeline message travels on its edge's main tag: its header and its leaves,
packed into one buffer when they are small.

Every gloo message costs both processes a wake-up (on a busy machine, more than copying
a few hundred kilobytes), so a message whose leaves are small goes as ONE buffer: 16
bytes of header (``code, microbatch`` as int64), then each leaf at a 16-byte aligned
offset. The receiver's leaves are views of that buffer (no copy). Larger messages go as
the header followed by one message per leaf. Both ends build the same :class:`Frame`
from the same layout, so they agree on which it is.

On the CPU a packed frame is written and read through one NumPy view of its buffer: each
torch call costs 10-40 us of dispatch when the process has just woken (four ranks on two
cores are woken at every message), so ``pack`` with about nine torch calls took ~85 us
and ``leaves`` ~45 us, a NumPy copy and ``from_numpy`` a third of that. The bytes are
the same either way (dtypes NumPy lacks, like bfloat16, and other devices use torch).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "HEADER_BYTES",
    "NONE_BITS",
    "PACK_LIMIT",
    "Frame",
    "frame_of",
    "none_code",
    "with_nones",
]

#: the header: two int64, the code and the microbatch.
HEADER_BYTES = 16

#: leaves up to this many bytes in all travel in the header's buffer.
PACK_LIMIT = 1 << 20

#: a gradient message's code marks the leaves 0 .. NONE_BITS - 1 that have no gradient
#: (bit i: leaf i); the sign bit stays clear, so the code never reads as POISON (-1).
NONE_BITS = 63

Layout = Sequence[tuple[torch.Size, torch.dtype]]

#: the NumPy dtype of each torch dtype a CPU frame can be written through.
_NUMPY: dict[torch.dtype, Any] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_HEADER = struct.Struct("=qq")


def _aligned(n: int) -> int:
    return (n + 15) // 16 * 16


class Frame:
    """The buffers of one message of ``layout`` (shape and dtype per leaf) on ``device``."""

    def __init__(self, layout: Layout, device: Any) -> None:
        self.layout = [(torch.Size(shape), dtype) for shape, dtype in layout]
        self.device = device
        sizes = [shape.numel() * dtype.itemsize for shape, dtype in self.layout]
        self.packed = sum(sizes) <= PACK_LIMIT
        self.offsets = []
        offset = HEADER_BYTES
        for size in sizes:
            self.offsets.append(offset)
            offset = _aligned(offset + size)
        self.total = offset if self.packed else HEADER_BYTES
        # Per leaf (offset, bytes, NumPy dtype, shape) when the frame goes through NumPy.
        self._views: list[tuple[int, int, Any, tuple[int, ...]]] | None = None
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind == "cpu" and all(d in _NUMPY for _, d in self.layout):
            self._views = [
                (o, n, _NUMPY[d], tuple(s))
                for o, n, (s, d) in zip(self.offsets, sizes, self.layout, strict=True)
            ]

    def buffers(self) -> list[torch.Tensor]:
        """Empty buffers to receive into, header first (with the header buffer's NumPy
        array, when the frame goes through NumPy, for :meth:`header` and :meth:`leaves`)."""
        if self._views is not None:
            raw = np.empty(self.total, dtype=np.uint8)
            out = _Buffers([torch.from_numpy(raw)])
            out.raw = raw
        else:
            out = _Buffers([torch.empty(self.total, dtype=torch.uint8, device=self.device)])
        if not self.packed:
            out += [torch.empty(s, dtype=d, device=self.device) for s, d in self.layout]
        return out

    def header(self, buffers: Sequence[torch.Tensor]) -> tuple[int, int]:
        """``(code, microbatch)`` of a received message."""
        if self._views is not None:
            code, mb = _HEADER.unpack_from(_array(buffers).data)
            return int(code), int(mb)
        code, mb = buffers[0][:HEADER_BYTES].view(torch.int64).tolist()
        return int(code), int(mb)

    def leaves(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The received leaves (views of the packed buffer, or the leaf buffers), free of
        any graph: a leaf may be made to require a gradient as it is."""
        if not self.packed:
            return list(buffers[1:])
        head = buffers[0]
        if self._views is not None:
            raw = _array(buffers)
            return [
                torch.from_numpy(raw[o : o + n].view(d).reshape(s)) for o, n, d, s in self._views
            ]
        return [
            head[o : o + s.numel() * d.itemsize].view(d).view(s).detach()
            for o, (s, d) in zip(self.offsets, self.layout, strict=True)
        ]

    def pack(self, code: int, mb: int, leaves: Sequence[torch.Tensor | None] | None) -> list[Any]:
        """The tensors to send: the header buffer (with the leaves when packed), then the
        leaves when not. ``leaves`` None sends the header without leaves (a message whose
        leaves go elsewhere): 16 bytes (gloo completes a receive with a shorter message),
        then, when not packed, dummies for the leaf buffers the receiver posted. A leaf
        None (a gradient that is none, marked in ``code``) keeps its place: zero bytes
        when packed, a dummy buffer when not, so the receiver's posted buffers fit."""
        size = self.total if leaves is not None else HEADER_BYTES
        if self._views is not None:
            raw = np.empty(size, dtype=np.uint8)
            head = torch.from_numpy(raw)
            _HEADER.pack_into(raw.data, 0, code, mb)
            if leaves is not None and self.packed:
                for (o, n, d, s), leaf in zip(self._views, leaves, strict=True):
                    if leaf is None:
                        raw[o : o + n] = 0
                    else:
                        raw[o : o + n].view(d).reshape(s)[...] = leaf.numpy(force=True)
                return [head]
        else:
            head = torch.empty(size, dtype=torch.uint8, device=self.device)
            head[:HEADER_BYTES].view(torch.int64).copy_(
                torch.tensor([code, mb], dtype=torch.int64, device=self.device)
            )
        if leaves is None:
            if self.packed:
                return [head]
            return [head] + [torch.empty(s, dtype=d, device=self.device) for s, d in self.layout]
        if self.packed:
            for o, (s, d), leaf in zip(self.offsets, self.layout, leaves, strict=True):
                part = head[o : o + s.numel() * d.itemsize]
                if leaf is None:
                    part.zero_()
                else:
                    part.view(d).view(s).copy_(leaf)
            return [head]
        return [head] + [
            torch.empty(s, dtype=d, device=self.device)
            if leaf is None
            else leaf.detach().to(self.device).contiguous()
            for (s, d), leaf in zip(self.layout, leaves, strict=True)
        ]


class _Buffers(list):  # type: ignore[type-arg]
    """A message's receive buffers; ``raw`` is the header buffer's NumPy array (or None)."""

    raw: Any = None


def _array(buffers: Sequence[torch.Tensor]) -> Any:
    """The header buffer as a NumPy array (kept by :meth:`Frame.buffers`, else made)."""
    raw = getattr(buffers, "raw", None)
    return buffers[0].numpy() if raw is None else raw


def none_code(
    grads: Sequence[torch.Tensor | None], layout: Layout, device: Any
) -> tuple[int, list[torch.Tensor | None]]:
    """The code of a gradient message whose leaves ``grads`` (of ``layout``) may be None,
    and the leaves to pack. Bit i of the code marks leaf i as none. A leaf past the
    :data:`NONE_BITS` the code has is sent as zeros (the receiver then sees a zero
    gradient for it: a model with that many output leaves loses only the None-ness)."""
    code = 0
    out = list(grads)
    for i, g in enumerate(grads):
        if g is None:
            if i < NONE_BITS:
                code |= 1 << i
            else:
                shape, dtype = layout[i]
                out[i] = torch.zeros(shape, dtype=dtype, device=device)
    return code, out


def with_nones(code: int, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The received gradient leaves with those the code marks as none replaced by None."""
    return [None if i < NONE_BITS and code >> i & 1 else t for i, t in enumerate(leaves)]


#: frames by layout and device (a step's messages repeat a few layouts).
_FRAMES: dict[tuple[Any, ...], Frame] = {}


def frame_of(layout: Layout, device: Any) -> Frame:
    """The :class:`Frame` of ``layout`` on ``device``, made once (frames are read-only)."""
    key = (*layout, device)
    frame = _FRAMES.get(key)
    if frame is None:
        if len(_FRAMES) >= 256:  # shapes that change every step must not pile up
            _FRAMES.clear()
        frame = _FRAMES[key] = Frame(layout, device)
    return frame
