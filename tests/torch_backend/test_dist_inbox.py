"""The backward messages between two real gloo processes: every kind decoded, poison, timeout.

Rank 0 plays a rank that sent rank 1 three tensors requiring grad; rank 1 answers them out
of order (a gradient, "no gradient", a 0-d gradient), then "done". Then rank 1 fails and
poisons what it owes, and finally stays silent past rank 0's timeout. After each, no thread
of rank 0 is left waiting on a receive.
"""

from __future__ import annotations

import time
from typing import Any

from ranks import run_ranks

SENT = [((3, 4), "float64"), ((), "float64"), ((5,), "float32")]


def _links(rank: int, seq: int) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend.dist_wire import Link
    from xgrad.torch_backend.failure import failure_channel

    peer = 1 - rank
    channel = failure_channel(dist.group.WORLD, f"test-inbox/{seq}")
    device = torch.device("cpu")
    link = Link(dist.group.WORLD, channel.store, channel.prefix, rank, peer, peer, seq, device)
    return {peer: link}, channel


def _messages(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.failure import RankError
    from xgrad.torch_backend import dist_inbox
    from xgrad.torch_backend.dist_bytes import DONE, GRAD, NO_GRAD, POISON, header
    from xgrad.torch_backend.dist_inbox import Inbox
    from xgrad.torch_backend.dist_wire import payload

    tensors = [torch.zeros(s, dtype=getattr(torch, d)) for s, d in SENT]
    sizes = [t.numel() * t.element_size() for t in tensors]
    out: dict[str, Any] = {}

    # 1. Every kind, answered out of order.
    links, channel = _links(rank, 1)
    if rank == 0:
        inbox = Inbox("test", links, {1: sizes}, {}, channel, timeout=20)
        got = []
        while not inbox.done_from_all():
            _, i, buf, err = inbox.next("test")
            kind, k = header(buf)
            value = payload(buf, tensors[k]).tolist() if kind == GRAD else None
            got.append((i, kind, k, value, err))
        inbox.send(1, DONE)
        out["got"] = got
    else:
        inbox = Inbox("test", links, {}, {0: sizes}, channel, timeout=20)
        try:  # a gradient of the wrong shape: this rank's error, nothing is sent
            inbox.send(0, GRAD, 2, torch.arange(4.0), tensors[2])
        except ValueError as exc:
            out["bad_shape"] = str(exc)
        inbox.send(0, GRAD, 2, torch.arange(5.0), tensors[2])
        inbox.send(0, NO_GRAD, 0)
        inbox.send(0, GRAD, 1, torch.tensor(2.5, dtype=torch.float64), tensors[1])
        inbox.send(0, DONE)
        inbox.next("test")  # rank 0's done
    inbox.close(failed=False)

    # 2. Rank 1 fails while alive: what it owes comes as poison.
    links, channel = _links(rank, 2)
    if rank == 0:
        inbox = Inbox("test", links, {1: sizes[:2]}, {}, channel, timeout=20)
        out["poison"] = [header(inbox.next("test")[2])[0] for _ in range(3)]
        out["poison_kind"] = POISON
    else:
        inbox = Inbox("test", links, {}, {0: sizes[:2]}, channel, timeout=20)
        inbox.send(0, GRAD, 0, torch.ones(3, 4, dtype=torch.float64), tensors[0])
        inbox.poison()
    inbox.close(failed=rank == 1)

    # 3. A silent peer: the wait ends at the timeout, named; then its poison drains it.
    links, channel = _links(rank, 3)
    if rank == 0:
        inbox = Inbox("test", links, {1: sizes[:1]}, {}, channel, timeout=0.5)
        start = time.monotonic()
        try:
            inbox.next("test")
            out["timeout"] = "no error"
        except RankError as exc:
            out["timeout"] = (str(exc), exc.failure.kind, time.monotonic() - start)
        inbox.close(failed=True)
    else:
        inbox = Inbox("test", links, {}, {0: sizes[:1]}, channel, timeout=20)
        time.sleep(1.5)
        inbox.poison()
        inbox.close(failed=True)  # keeps the poison's send referenced until it is written
    deadline = time.monotonic() + 5
    while any(t.waiting for t in dist_inbox._made) and time.monotonic() < deadline:
        time.sleep(0.01)
    out["waiting"] = [t.waiting for t in dist_inbox._made]
    return out


def test_messages_of_every_kind_poison_and_timeout() -> None:
    results, codes = run_ranks(_messages, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    # The order rank 1 sent in; message i of the pass lands in the i-th receive.
    assert out["got"] == [
        (0, 0, 2, [0.0, 1.0, 2.0, 3.0, 4.0], None),
        (1, 1, 0, None, None),
        (2, 0, 1, 2.5, None),
        (3, 2, 0, None, None),
    ]
    assert out["poison"] == [0, out["poison_kind"], out["poison_kind"]]
    msg, kind, waited = out["timeout"]
    assert kind == "timeout" and "timed out after 0.5 s" in msg, msg
    assert 0.4 < waited < 0.5 + 3.0  # on a loaded machine
    assert not any(out["waiting"])
    assert results[1][0] == "ok" and not any(results[1][1]["waiting"])
    assert results[1][1]["bad_shape"] == (
        "the gradient for rank 0 has shape (4,), the received tensor (5,)"
    )
