"""How one pipeline message travels on its edge's main tag: its header and its leaves,
packed into one buffer when they are small.

Every gloo message costs both processes a wake-up (on a busy machine, more than copying
a few hundred kilobytes), so a message whose leaves are small goes as ONE buffer: 16
bytes of header (``code, microbatch`` as int64), then each leaf at a 16-byte aligned
offset. The receiver's leaves are views of that buffer (no copy). Larger messages go as
the header followed by one message per leaf. Both ends build the same :class:`Frame`
from the same layout, so they agree on which it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HEADER_BYTES", "PACK_LIMIT", "Frame"]

#: the header: two int64, the code and the microbatch.
HEADER_BYTES = 16

#: leaves up to this many bytes in all travel in the header's buffer.
PACK_LIMIT = 1 << 20

Layout = Sequence[tuple[torch.Size, torch.dtype]]


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

    def buffers(self) -> list[torch.Tensor]:
        """Empty buffers to receive into, header first."""
        head = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        if self.packed:
            return [head]
        return [head] + [torch.empty(s, dtype=d, device=self.device) for s, d in self.layout]

    def header(self, buffers: Sequence[torch.Tensor]) -> tuple[int, int]:
        """``(code, microbatch)`` of a received message."""
        code, mb = buffers[0][:HEADER_BYTES].view(torch.int64).tolist()
        return int(code), int(mb)

    def leaves(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The received leaves (views of the packed buffer, or the leaf buffers)."""
        if not self.packed:
            return list(buffers[1:])
        head = buffers[0]
        return [
            head[o : o + s.numel() * d.itemsize].view(d).view(s)
            for o, (s, d) in zip(self.offsets, self.layout, strict=True)
        ]

    def pack(self, code: int, mb: int, leaves: Sequence[torch.Tensor] | None) -> list[Any]:
        """The tensors to send: the header buffer (with the leaves when packed), then the
        leaves when not. ``leaves`` None sends the header without leaves (a message whose
        leaves go elsewhere): 16 bytes (gloo completes a receive with a shorter message),
        then, when not packed, dummies for the leaf buffers the receiver posted."""
        size = self.total if leaves is not None else HEADER_BYTES
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
                head[o : o + s.numel() * d.itemsize].view(d).view(s).copy_(leaf)
            return [head]
        return [head] + [leaf.detach().contiguous() for leaf in leaves]
