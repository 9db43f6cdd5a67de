"""How tensors and their gradients travel between the ranks of a distributed autograd context.

A message is a small header in the group's c10d store and, unless it carries no data,
the tensor by c10d point-to-point on the group (gloo or NCCL, the same code)::

    forward   A -> B, i-th tensor:    key .../A>B/f/i   = dtype, requires_grad, shape
    backward  B -> A, j-th gradient:  key .../B>A/b<p>/j = k, has_gradient   (pass p)

``k`` numbers A's sends to B that require grad, so gradients may come back in any order,
and a ``recv`` whose gradient is not needed still answers ("no gradient") so that its
sender does not wait. The receiver posts its receive only once the header shows the send
was posted: no receive is ever left waiting for a send that a failed rank never made
(gloo can neither cancel one nor time one out without closing the group's connections).
Keys and tags carry the context's sequence number, so nothing of a failed context
matches a message of a later one.
"""

from __future__ import annotations

from typing import Any

import torch

from xgrad.failure import KeyValueStore

__all__ = ["DTYPES", "Link", "header_device", "tag"]

#: dtypes that may travel, by code.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
#: tags live above 2**30, clear of the small tags other users of the group pick.
_TAG_BASE = 1 << 30
_SEQ_MOD = 1 << 25
FORWARD, BACKWARD = 0, 1


def tag(seq: int, stream: int) -> int:
    """The c10d tag of ``stream`` in the context with sequence number ``seq`` (< 2**31)."""
    return _TAG_BASE + ((seq % _SEQ_MOD) << 2) + stream


def header_device(group: Any) -> torch.device:
    """Where received tensors land: the current GPU for NCCL groups, the CPU otherwise."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Link:
    """The messages of one context between this rank and one peer.

    Args:
        pg: the process group (its ``send``/``recv`` take group ranks).
        store: the group's store (headers).
        prefix: the context's namespace in the store.
        me, peer: global ranks of this process and of the peer.
        group_peer: the peer's rank within ``pg``.
        seq: the context's sequence number (tags).
        device: where received tensors land (:func:`header_device`).
    """

    def __init__(
        self,
        pg: Any,
        store: KeyValueStore,
        prefix: str,
        me: int,
        peer: int,
        group_peer: int,
        seq: int,
        device: torch.device,
    ) -> None:
        self.pg = pg
        self.store = store
        self.peer = peer
        self.group_peer = group_peer
        self.device = device
        self._out = f"{prefix}/{me}>{peer}"
        self._in = f"{prefix}/{peer}>{me}"
        self._tags = (tag(seq, FORWARD), tag(seq, BACKWARD))
        self._count: dict[str, int] = {}

    def _next(self, stream: str) -> int:
        i = self._count.get(stream, 0)
        self._count[stream] = i + 1
        return i

    def _peek(self, stream: str) -> str:
        return f"{self._in}/{stream}/{self._count.get(self._in + stream, 0)}"

    def _take(self, stream: str) -> bytes:
        key = self._peek(stream)
        self._next(self._in + stream)
        return self.store.get(key)

    # forward: tensors

    def send_tensor(self, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Post the send of ``t``; returns ``(work, the buffer it reads)``."""
        if t.dtype not in _CODE:
            raise TypeError(f"send: dtype {t.dtype} cannot be sent; supported: {list(DTYPES)}")
        data = t.detach().to(self.device).contiguous()
        work = self.pg.send([data], self.group_peer, self._tags[FORWARD])
        head = [_CODE[t.dtype], int(t.requires_grad), *t.shape]
        self.store.set(f"{self._out}/f/{self._next('f')}", ",".join(map(str, head)).encode())
        return work, data

    def tensor_ready(self) -> bool:
        """Whether the peer posted the next tensor this rank will receive from it."""
        return self.store.check([self._peek("f")])

    def recv_tensor(self) -> tuple[Any, torch.Tensor, bool]:
        """Post the receive of the next tensor (call once ready): ``(work, buffer, requires_grad)``."""
        head = [int(v) for v in self._take("f").decode().split(",")]
        code, requires_grad, shape = head[0], bool(head[1]), head[2:]
        buf = torch.empty(shape, dtype=DTYPES[code], device=self.device)
        return self.pg.recv([buf], self.group_peer, self._tags[FORWARD]), buf, requires_grad

    # backward: gradients

    def send_grad(self, p: int, k: int, grad: torch.Tensor | None, like: torch.Tensor) -> Any:
        """Post the gradient for the peer's ``k``-th grad-requiring send in pass ``p``.

        ``grad`` None tells the peer no gradient comes. Returns the send's work (or None).
        """
        work = None
        if grad is not None:
            if grad.shape != like.shape:
                raise RuntimeError(
                    f"the gradient for rank {self.peer} has shape {tuple(grad.shape)}, "
                    f"the received tensor {tuple(like.shape)}"
                )
            data = grad.to(dtype=like.dtype, device=self.device).contiguous()
            work = (self.pg.send([data], self.group_peer, self._tags[BACKWARD]), data)
        stream = f"b{p}"
        self.store.set(
            f"{self._out}/{stream}/{self._next(stream)}", f"{k},{int(work is not None)}".encode()
        )
        return work

    def grad_ready(self, p: int) -> bool:
        """Whether the peer posted its next gradient message of pass ``p``."""
        return self.store.check([self._peek(f"b{p}")])

    def recv_grad(
        self, p: int, sent: dict[int, torch.Tensor]
    ) -> tuple[int, Any, torch.Tensor | None]:
        """Take the next gradient message (call once ready): ``(k, work or None, buffer)``.

        ``sent`` maps ``k`` to the tensor this rank sent, whose shape the gradient has.
        """
        k, has_grad = (int(v) for v in self._take(f"b{p}").decode().split(","))
        if k not in sent:
            raise RuntimeError(f"rank {self.peer} sent a gradient for send {k}, which was not made")
        if not has_grad:
            return k, None, None
        like = sent[k]
        buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return k, self.pg.recv([buf], self.group_peer, self._tags[BACKWARD]), buf
