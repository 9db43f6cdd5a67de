"""How a tensor and a backward message look in bytes, between the ranks of a context.

A forward tensor travels as it is where gloo moves its dtype, else as its bytes (as
PyTorch's RPC sends them); its forward header names its dtype by code (:data:`DTYPES`),
and the step label of its context when it has one (``dist_autograd.context(step=...)``).
A backward message is a header of two native int64 (layout: :mod:`.dist_slots`), its
kind and ``k``, then the payload::

    kind GRAD: the gradient of A's k-th grad-requiring send to B (the payload, the sent
               tensor's shape and dtype); NO_GRAD: none flows back (not needed, or zero);
    DONE: B finished the pass; POISON: B failed, read the failure channel.

Kept apart from the messages' routes (:class:`.dist_wire.Link`: tags, the store's
headers, the sends and receives) so that the encoding is read in one place, by the
link and by the pass that reads what landed (:mod:`.dist_pass`).
"""

from __future__ import annotations

import torch

from xgrad.torch_backend.dist_slots import HEADER, HEADER_BYTES

__all__ = [
    "AS_BYTES",
    "DONE",
    "DTYPES",
    "GRAD",
    "NO_GRAD",
    "POISON",
    "as_bytes",
    "flat_bytes",
    "forward_header",
    "forward_step",
    "header",
    "message_head",
    "read_forward_header",
]

#: kinds of backward messages (their header's layout: :mod:`.dist_slots`).
GRAD, NO_GRAD, DONE, POISON = 0, 1, 2, 3

#: dtypes gloo moves: they travel as they are.
_GLOO_DTYPES = (
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
#: dtypes gloo does not move: they travel as their bytes (:func:`as_bytes`), as PyTorch's
#: RPC sends them (those this torch has).
_BYTE_NAMES = "uint16 uint32 uint64 complex32 float8_e4m3fn float8_e5m2 float8_e4m3fnuz"
_BYTE_NAMES += " float8_e5m2fnuz float8_e8m0fnu"
_BYTE_DTYPES = tuple(
    dt
    for dt in (getattr(torch, name, None) for name in _BYTE_NAMES.split())
    if isinstance(dt, torch.dtype)
)
#: dtypes that may travel, by code (the byte ones after the others, whose codes stay).
DTYPES: tuple[torch.dtype, ...] = (*_GLOO_DTYPES, *_BYTE_DTYPES)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
AS_BYTES = frozenset(_BYTE_DTYPES)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t``, one dimension, sharing its storage."""
    return t.reshape(-1).view(torch.uint8)


def forward_header(t: torch.Tensor, step: bytes | None = None) -> bytes:
    """The forward header of ``t`` (its dtype's code, whether it requires grad, its
    shape; then ``|`` and the context's ``step`` label, when it has one), refusing a
    tensor that cannot be sent."""
    if t.dtype not in _CODE:
        raise TypeError(f"send: dtype {t.dtype} cannot be sent; supported: {list(DTYPES)}")
    if t.layout != torch.strided:
        raise TypeError(f"send: a {t.layout} tensor cannot be sent; send t.to_dense()")
    head = ",".join(map(str, [_CODE[t.dtype], int(t.requires_grad), *t.shape])).encode()
    return head if step is None else head + b"|" + step


def read_forward_header(header: bytes) -> tuple[torch.dtype, bool, list[int]]:
    """``(dtype, requires_grad, shape)`` of a tensor, from its forward header."""
    head = [int(v) for v in header.partition(b"|")[0].decode().split(",")]
    return DTYPES[head[0]], bool(head[1]), head[2:]


def forward_step(header: bytes) -> bytes | None:
    """The step label a forward header carries (None: its context has none)."""
    _, bar, step = header.partition(b"|")
    return step if bar else None


#: the header bytes of each (kind, k, device), made once: sends only read their buffer.
_HEADS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def message_head(kind: int, k: int, device: torch.device) -> torch.Tensor:
    """The header bytes of a backward message of ``kind`` and ``k`` on ``device``."""
    made = _HEADS.get((kind, k, device))
    if made is None:
        if len(_HEADS) >= 4096:
            _HEADS.clear()
        made = torch.tensor([kind, k], dtype=torch.int64).view(torch.uint8).to(device)
        _HEADS[(kind, k, device)] = made
    return made


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat. A one-element or empty tensor can be "contiguous" with stride
    0 (the gradient of ``sum()`` expanded to shape ``(1,)`` or ``(0,)``), which a byte view
    refuses: copied (an empty one is made anew: it has no bytes to copy). A conjugate or
    negative view (the gradient of ``r.conj()``) has its bit resolved first: a byte view
    would read the stored values without it."""
    flat = t.resolve_conj().resolve_neg().contiguous().view(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)  # clone() keeps stride 0
    return flat.view(torch.uint8)


def header(buf: torch.Tensor) -> tuple[int, int]:
    """``(kind, k)`` of a received backward message.

    A CPU buffer is read through its NumPy view (a third of the tensor ops' time, on the
    receiving rank's hop); the header was written as two native int64.
    """
    if buf.device.type == "cpu":
        kind, k = HEADER.unpack_from(buf.numpy().data)
        return kind, k
    kind, k = buf[:HEADER_BYTES].view(torch.int64).tolist()
    return int(kind), int(k)
