"""A forward header is taken in one store round trip where the store has ``compare_set``.

``Link.take_header`` reads the next tensor's header with a compare-and-set that neither
creates nor changes the key (every c10d store has it), or with a check and a read on a
store without it (xgrad's in-memory one). Both ways: nothing before the peer writes, the
headers in order after, no key made by a look, and the count advances only on a take.
A header that carries another step label than the receiver's context (a rank that skipped
a context, ``dist_autograd.context(step=...)``) is returned and not taken: the receive
raises, and the tensor counts as unreceived, so its sender's pass is answered.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from xgrad.failure import MemoryStore
from xgrad.torch_backend.dist_bytes import forward_header, forward_step, read_forward_header
from xgrad.torch_backend.dist_wire import Link


def _pair(store: Any) -> tuple[Link, Link]:
    """Rank 0's and rank 1's links to each other on ``store`` (no group: headers only)."""
    cpu = torch.device("cpu")
    return (
        Link(None, store, "ctx/1", 0, 1, 1, 1, cpu),
        Link(None, store, "ctx/1", 1, 0, 0, 1, cpu),
    )


@pytest.mark.parametrize("kind", ["c10d", "memory"])
def test_headers_are_taken_in_order_and_a_look_makes_no_key(kind: str) -> None:
    store = dist.HashStore() if kind == "c10d" else MemoryStore()
    sender, receiver = _pair(store)
    assert receiver.take_header() is None
    assert receiver.take_header() is None
    assert not store.check(["ctx/1/0>1/f/0"])  # looking did not create the key
    for head in (b"0,1,2,3", b"1,0,5"):
        store.set(f"ctx/1/0>1/f/{sender._next('f')}", head)
    assert receiver.take_header() == b"0,1,2,3"
    assert receiver.take_header() == b"1,0,5"
    assert receiver.take_header() is None
    assert store.get("ctx/1/0>1/f/0") == b"0,1,2,3"  # taking did not change it


@pytest.mark.parametrize(("theirs", "mine"), [(b"4", b"5"), (None, b"5"), (b"4", None)])
def test_a_header_of_another_step_is_returned_untaken_and_counts_as_unreceived(
    theirs: bytes | None, mine: bytes | None
) -> None:
    store = MemoryStore()
    cpu = torch.device("cpu")
    sender = Link(None, store, "ctx/1", 0, 1, 1, 1, cpu, theirs)
    receiver = Link(None, store, "ctx/1", 1, 0, 0, 1, cpu, mine)
    head = forward_header(torch.ones(2, 3, requires_grad=True), theirs)
    assert read_forward_header(head) == (torch.float32, True, [2, 3])
    assert forward_step(head) == theirs
    store.set(f"ctx/1/0>1/f/{sender._next('f')}", head)
    assert receiver.take_header() == head
    assert receiver.take_header() == head  # not taken: it is still the next one
    assert receiver.unreceived() == 1  # its gradient is answered (with poison) on failure
    matching = Link(None, store, "ctx/1", 1, 0, 0, 1, cpu, theirs)
    assert matching.take_header() == head
    assert matching.take_header() is None
    assert matching.unreceived() == 0
