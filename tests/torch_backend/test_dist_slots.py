"""Buffers made ahead of a pass's hops read and write the same messages as the ordinary way."""

from __future__ import annotations

import torch

from xgrad.torch_backend.dist_bytes import GRAD, NO_GRAD, header
from xgrad.torch_backend.dist_slots import HEADER_BYTES, ReceiveViews, ReplyBuffers
from xgrad.torch_backend.dist_wire import payload


def _message(kind: int, k: int, grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A message as :meth:`Link.send_backward` builds it without a made buffer."""
    head = torch.tensor([kind, k], dtype=torch.int64).view(torch.uint8)
    body = grad.to(like.dtype).contiguous().view(-1).view(torch.uint8)
    return torch.cat([head, body])


def test_a_filled_reply_is_the_ordinary_message_and_casts_like_it() -> None:
    like = torch.zeros(3, 4, dtype=torch.float32)
    grad = torch.randn(4, 3, dtype=torch.float64).t()  # another dtype, not contiguous
    replies = ReplyBuffers()
    replies.make([like, like])  # made once per tensor
    out = replies.fill(GRAD, 5, grad, like)
    assert out is not None
    assert torch.equal(out, _message(GRAD, 5, grad, like))
    assert replies.fill(GRAD, 5, grad, like) is None  # sent once: the next is made anew
    replies.make([like])
    replies.clear()
    assert replies.fill(GRAD, 5, grad, like) is None


def test_receive_views_read_the_header_and_view_the_payload_as_the_tensor_sent() -> None:
    sent = {0: torch.zeros(2, 3), 1: torch.zeros(5, dtype=torch.float64)}
    slot = HEADER_BYTES + 5 * 8
    bufs = [torch.zeros(slot, dtype=torch.uint8) for _ in range(2)]
    views = ReceiveViews()
    views.make(bufs, sent)
    grad = torch.arange(5, dtype=torch.float64)
    msg = _message(GRAD, 1, grad, sent[1])
    bufs[1][: msg.numel()] = msg  # what gloo writes into a posted receive
    assert views.header(bufs[1]) == header(bufs[1]) == (GRAD, 1)
    view = views.payload(bufs[1], 1)
    assert view is not None and torch.equal(view, payload(bufs[1], sent[1]))
    assert torch.equal(view, grad)
    bufs[0][:HEADER_BYTES] = _message(NO_GRAD, 0, torch.zeros(0), torch.zeros(0))
    assert views.header(bufs[0]) == (NO_GRAD, 0)
    other = torch.zeros(slot, dtype=torch.uint8)  # not made here: the ordinary way
    assert views.header(other) is None and views.payload(other, 0) is None


def test_a_peer_sent_many_tensors_gets_its_payloads_viewed_when_they_land() -> None:
    sent = {k: torch.zeros(2) for k in range(9)}
    buf = torch.zeros(HEADER_BYTES + 8, dtype=torch.uint8)
    views = ReceiveViews()
    views.make([buf], sent)
    assert views.header(buf) == (0, 0)  # the header is still read through its view
    assert views.payload(buf, 3) is None  # the caller views it (dist_wire.payload)
