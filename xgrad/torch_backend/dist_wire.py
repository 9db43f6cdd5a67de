"""How tensors and their gradients travel between the ranks of a distributed autograd context.

Forward, a tensor's header goes through the group's c10d store (its shape is not known
to the receiver) and the tensor by c10d point-to-point (gloo or NCCL, the same code)::

    forward   A -> B, i-th tensor:    key .../A>B/f/i = dtype, requires_grad, shape[|step]

The receiver posts its receive only once the header shows the send was posted, so no
receive waits for a send that a failed rank never made. A context opened with a step
label writes it into every header; the receiver takes a header only when it carries its
own context's label (or, both without one, none), so a rank that skipped a context is
named at its first transfer, at no cost to a context without labels.

Backward, everything goes by point-to-point. At the start of a pass both sides know
every message between them: for each tensor A sent B that requires grad, one message
B -> A on the context's gradient tag (in the order B's engine answers), then B's "done"
on its backward tag; a message is a header (kind, k) and a payload, in the bytes and
kinds of :mod:`.dist_bytes`.

So A posts its receives first (:class:`xgrad.torch_backend.dist_inbox.Inbox`) and
gloo writes B's message the moment B sends it. The gradients and the "done"s have tags of
their own, so that a rank waits for each kind separately (the gradients while its
engine runs, the dones at the end); a poison goes on the tag of the message it stands
for. Tags carry the context's sequence number,
so nothing of a failed context matches a message of a later one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xgrad.failure import KeyValueStore
from xgrad.torch_backend.dist_bytes import (
    AS_BYTES,
    DONE,
    GRAD,
    POISON,
    as_bytes,
    flat_bytes,
    forward_header,
    forward_step,
    message_head,
    read_forward_header,
)
from xgrad.torch_backend.dist_bytes import DTYPES as DTYPES
from xgrad.torch_backend.dist_slots import HEADER_BYTES, ReplyBuffers, payload

__all__ = [
    "BACKWARD",
    "DTYPES",
    "GRADIENTS",
    "HEADER_BYTES",
    "SEVER",
    "Link",
    "header_device",
    "payload",
    "tag",
]

#: what ``compare_set`` of an absent forward header returns (no header is this value).
_ABSENT = b"\x00absent"
#: tags live above 2**30, clear of the small tags other users of the group pick.
_TAG_BASE = 1 << 30
_SEQ_MOD = 1 << 25
#: streams of a context's tags: forward tensors, "done", gradients; SEVER only ever times
#: out (closes a lost group's connections).
FORWARD, BACKWARD, GRADIENTS, SEVER = 0, 1, 2, 3


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
        step: the context's step label, encoded (None: it has none).
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
        step: bytes | None = None,
    ) -> None:
        self.pg = pg
        self.store = store
        self.peer = peer
        self.group_peer = group_peer
        self.device = device
        self.step = step
        self._out = f"{prefix}/{me}>{peer}"
        self._in = f"{prefix}/{peer}>{me}"
        self._tags = (tag(seq, FORWARD), tag(seq, BACKWARD), tag(seq, GRADIENTS))
        self._count: dict[str, int] = {}
        # NCCL receives only a message of the posted size; gloo one up to it.
        self._exact = device.type != "cpu"
        self._reply_slot = HEADER_BYTES
        self._replies_left = 0
        #: the buffers of the gradients owed the peer, made when this rank first waits
        self.replies = ReplyBuffers()

    def _next(self, stream: str) -> int:
        i = self._count.get(stream, 0)
        self._count[stream] = i + 1
        return i

    def _peek(self, stream: str) -> str:
        return f"{self._in}/{stream}/{self._count.get(self._in + stream, 0)}"

    # forward: tensors

    def send_tensor(self, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Post the send of ``t``; returns ``(work, the buffer it reads)``."""
        head = forward_header(t, self.step)  # refuses what cannot be sent, before anything is
        # A copy, as PyTorch's RPC serialises at the call: what the receiver gets is the
        # tensor as it was, whatever the sender writes into it before gloo reads it.
        data = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        data.copy_(t.detach())
        wire = as_bytes(data) if t.dtype in AS_BYTES else data
        work = self.pg.send([wire], self.group_peer, self._tags[FORWARD])
        self.store.set(f"{self._out}/f/{self._next('f')}", head)
        return work, data

    def headers(self) -> list[str]:
        """The keys of the forward headers this rank wrote to the peer in the context."""
        return [f"{self._out}/f/{i}" for i in range(self._count.get("f", 0))]

    def forget_headers(self) -> None:
        """Delete the forward headers this rank wrote to the peer. Only once every send of
        the context was received (past the exit barrier): the peer read each header before
        its receive counted. After a failure they stay (:meth:`unreceived` reads them)
        until a later context's exit (:mod:`.dist_leftovers`).
        Called once, as the context closes: a context per step must not grow the store."""
        for key in self.headers():
            self.store.delete_key(key)

    def take_header(self) -> bytes | None:
        """The header of the next tensor from the peer, taken, if the peer wrote it; else
        None (one that carries another step label than this context's is returned, not
        taken). One store round trip where the store has ``compare_set`` (every c10d
        store): a compare-and-set of a key to the value it would need to hold already
        returns the key's value, and neither creates nor changes it; a check then a read
        otherwise. On the forward's path, a receive found its header by polling, then
        read it: one round trip fewer per received tensor."""
        key = self._peek("f")
        compare_set = getattr(self.store, "compare_set", None)
        if compare_set is None:
            if not self.store.check([key]):
                return None
            value: bytes = self.store.get(key)
        else:
            value = compare_set(key, _ABSENT, _ABSENT)
            if value == _ABSENT:
                return None
        if forward_step(value) == self.step:
            self._next(self._in + "f")
        # else left untaken: the caller raises (a peer in another step), and the tensor
        # counts as unreceived, its gradient answered with poison (:meth:`unreceived`)
        return value

    def recv_tensor(self, header: bytes) -> tuple[Any, torch.Tensor, bool]:
        """Post the receive of the next tensor, whose ``header`` was taken
        (:meth:`take_header`): ``(work, buffer, requires_grad)``."""
        dtype, requires_grad, shape = read_forward_header(header)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        wire = as_bytes(buf) if buf.dtype in AS_BYTES else buf  # lands in buf's storage
        return self.pg.recv([wire], self.group_peer, self._tags[FORWARD]), buf, requires_grad

    def unreceived(self) -> int:
        """How many tensors requiring grad the peer sent that this rank did not receive.

        Read from the forward headers in the store, one lookup each: only after a failure,
        when the peer may wait for their gradients (:meth:`release` answers each).
        """
        n, i = 0, self._count.get(self._in + "f", 0)
        while self.store.check([f"{self._in}/f/{i}"]):
            n += read_forward_header(self.store.get(f"{self._in}/f/{i}"))[1]
            i += 1
        return n

    # backward: gradients, "done", poison (see the module docstring)

    def start_backward(self, replies: Sequence[int]) -> None:
        """Begin a pass: ``replies`` are the payload bytes of the gradients owed to the peer."""
        self._reply_slot = HEADER_BYTES + max(replies, default=0)
        self._replies_left = len(replies)
        self.replies.clear()

    def post_gradients(self, sizes: Sequence[int]) -> list[tuple[Any, torch.Tensor]]:
        """Post the receives of the peer's gradient messages, one per expected gradient
        (:meth:`post_done` posts its "done" apart). ``sizes``: payload bytes of each (the
        tensors this rank sent the peer that require grad). Returns ``(work, buffer)`` in
        the order they will complete."""
        slot = HEADER_BYTES + max(sizes, default=0)
        return [self._post(slot, GRADIENTS) for _ in sizes]

    def post_done(self) -> tuple[Any, torch.Tensor]:
        """Post the receive of the peer's "done" (or its poison)."""
        return self._post(HEADER_BYTES, BACKWARD)

    def _post(self, nbytes: int, stream: int) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.pg.recv([buf], self.group_peer, self._tags[stream]), buf

    def send_backward(
        self,
        kind: int,
        k: int,
        grad: torch.Tensor | None,
        like: torch.Tensor | None = None,
        *,
        final: bool = False,
    ) -> tuple[Any, torch.Tensor]:
        """Send one message of a pass: ``(work, buffer)``.

        A gradient (``kind`` GRAD, for the peer's ``k``-th send, received here as ``like``),
        "no gradient" (NO_GRAD), POISON, or DONE after every gradient. A POISON stands for
        the next gradient owed, or with ``final`` for the "done" (DONE always is). On NCCL
        every message fills the receive the peer posted for it exactly (NCCL cannot receive
        a shorter message); gloo sends only the bytes used.
        """
        final = final or kind == DONE
        reply = self._replies_left > 0 and not final
        if reply:
            self._replies_left -= 1
        parts = [message_head(kind, k, self.device)]
        used = HEADER_BYTES
        if kind == GRAD:
            assert grad is not None and like is not None
            # A ValueError, not gloo's RuntimeError: this rank's own failure, never taken
            # for a lost peer.
            if grad.shape != like.shape:
                raise ValueError(
                    f"the gradient for rank {self.peer} has shape {tuple(grad.shape)}, "
                    f"the received tensor {tuple(like.shape)}"
                )
            made = None
            try:
                # a buffer made ahead (gloo): the header written, the gradient copied and cast
                made = None if self._exact else self.replies.fill(kind, k, grad, like)
                if made is None:
                    if grad.dtype != like.dtype or grad.device != self.device:
                        grad = grad.to(self.device, like.dtype)
                    parts.append(flat_bytes(grad))
            except RuntimeError as exc:
                raise ValueError(
                    f"the gradient for rank {self.peer} cannot be sent: {exc}"
                ) from exc
            if made is not None:
                return self.pg.send([made], self.group_peer, self._tags[GRADIENTS]), made
            used += like.numel() * like.element_size()
        if reply and self._exact and self._reply_slot > used:
            parts.append(
                torch.zeros(self._reply_slot - used, dtype=torch.uint8, device=self.device)
            )
        # One copy into a fresh buffer (a header alone is a shared constant: sends only read).
        buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        stream = BACKWARD if final else GRADIENTS
        return self.pg.send([buf], self.group_peer, self._tags[stream]), buf

    def release(self, final: bool) -> tuple[Any, torch.Tensor]:
        """A poison outside any pass's accounting, for a gradient (or with ``final`` the
        "done") the peer may wait for: it touches no counter, so another thread may send
        it while the pass's own thread waits (see :mod:`.dist_ledger`)."""
        buf = message_head(POISON, 0, self.device)
        if self._exact and not final and self._reply_slot > HEADER_BYTES:
            pad = torch.zeros(
                self._reply_slot - HEADER_BYTES, dtype=torch.uint8, device=self.device
            )
            buf = torch.cat([buf, pad])
        stream = BACKWARD if final else GRADIENTS
        return self.pg.send([buf], self.group_peer, self._tags[stream]), buf
