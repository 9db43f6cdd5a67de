"""A backward pass's message buffers, made while the rank waits rather than on its hop.

A rank's hop in a distributed backward pass is a little Python between two waits: read
the header of the gradient that landed, view its payload as the tensor sent, compute,
put the gradient for the peer behind a header and send it. Right after a wake-up, each
torch call there costs many times its warm cost: traced on ``bench dist-autograd``, the
header and the two views of a landed gradient took about 100 µs, against 5 µs warm.
Everything in those calls but the gradient's bytes is known when the pass starts: the
size, dtype and shape of every message both ways. So when a rank first waits (the
inbox's ``arm``), it makes:

* for each posted receive of a gradient, the memoryview its header is read through and
  its payload viewed as each tensor it may be the gradient of (:class:`ReceiveViews`);
* for each gradient it owes a peer, the message buffer, its header's memoryview and its
  payload viewed as the received tensor (:class:`ReplyBuffers`): a send is then one
  header write and one copy.

A message whose buffers were not made (sent before the rank's first wait, or on NCCL,
whose buffers live on a GPU) takes the ordinary way, :mod:`.dist_wire`. The header's
layout is defined here, below both.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["HEADER", "HEADER_BYTES", "ReceiveViews", "ReplyBuffers", "make_ahead", "payload"]

#: a backward message's header: two native int64, its kind and k (:mod:`.dist_wire`).
HEADER = struct.Struct("=qq")
HEADER_BYTES = HEADER.size
#: a peer sent more tensors than this: its receives' payloads are viewed when they land
#: (each receive would need a view per tensor).
_VIEWS_MAX = 8


def payload(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The payload of backward message ``buf`` viewed as tensor ``like`` (no copy)."""
    n = like.numel() * like.element_size()
    return buf[HEADER_BYTES : HEADER_BYTES + n].view(like.dtype).view(like.shape)


class ReceiveViews:
    """Header memoryviews and payload views of a pass's posted CPU receives."""

    def __init__(self) -> None:
        # id(buffer) -> (buffer, its header's memoryview, {k: payload as the k-th tensor})
        self._made: dict[int, tuple[torch.Tensor, memoryview, dict[int, torch.Tensor]]] = {}

    def make(self, bufs: Iterable[torch.Tensor], sent: Mapping[int, torch.Tensor]) -> None:
        """Views of ``bufs`` (receives of gradients from one peer) as each tensor in ``sent``
        (``k`` -> the k-th grad-requiring tensor sent that peer)."""
        for buf in bufs:
            if buf.device.type != "cpu":
                return
            views = {} if len(sent) > _VIEWS_MAX else {k: payload(buf, t) for k, t in sent.items()}
            self._made[id(buf)] = (buf, buf.numpy().data, views)

    def header(self, buf: torch.Tensor) -> tuple[int, int] | None:
        """``(kind, k)`` of a landed message, or None for a buffer not made here."""
        made = self._made.get(id(buf))
        if made is None:
            return None
        kind, k = HEADER.unpack_from(made[1])
        return kind, k

    def payload(self, buf: torch.Tensor, k: int) -> torch.Tensor | None:
        """The payload of a landed GRAD message for the k-th tensor, or None if not made."""
        made = self._made.get(id(buf))
        return None if made is None else made[2].get(k)


class ReplyBuffers:
    """One link's message buffers for the gradients this rank owes its peer in a pass."""

    def __init__(self) -> None:
        # id(received tensor) -> (the tensor, message buffer, header memoryview, payload view)
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor, memoryview, torch.Tensor]] = {}

    def clear(self) -> None:
        self._made.clear()

    def make(self, received: Iterable[torch.Tensor]) -> None:
        """Buffers for the gradients of ``received`` (CPU tensors of this link's peer)."""
        for like in received:
            if id(like) not in self._made:
                out = torch.empty(
                    HEADER_BYTES + like.numel() * like.element_size(), dtype=torch.uint8
                )
                self._made[id(like)] = (like, out, out.numpy().data, payload(out, like))

    def fill(self, kind: int, k: int, grad: torch.Tensor, like: torch.Tensor) -> Any:
        """The message for ``grad`` (the gradient of ``like``) in its buffer, taken out of
        this set (a buffer is sent once); None where none was made."""
        made = self._made.pop(id(like), None)
        if made is None:
            return None
        _, out, head, view = made
        HEADER.pack_into(head, 0, kind, k)
        view.copy_(grad)
        return out


def make_ahead(
    views: ReceiveViews,
    links: Mapping[int, Any],
    posted: Mapping[int, Sequence[torch.Tensor]],
    sent: Mapping[int, Mapping[int, torch.Tensor]],
    owed: Mapping[Any, tuple[int, torch.Tensor]],
) -> None:
    """What a rank makes when it first waits: views of the gradient receives just
    ``posted`` (peer -> buffers) as the tensors ``sent`` each peer (peer -> {k: tensor}),
    and on each link (peer -> :class:`~.dist_wire.Link`) the buffers of the gradients
    still ``owed`` (``(peer, received tensor)`` values; CPU links and tensors only)."""
    for peer, bufs in posted.items():
        tensors = sent.get(peer)
        if tensors:
            views.make(bufs, tensors)
    by_peer: dict[int, list[torch.Tensor]] = {}
    for peer, t in owed.values():
        by_peer.setdefault(peer, []).append(t)
    for peer, received in by_peer.items():
        link = links[peer]
        if link.device.type == "cpu" and all(t.device.type == "cpu" for t in received):
            link.replies.make(received)
