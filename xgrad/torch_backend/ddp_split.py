"""At world size 2, a large bucket's all-reduce in two halves at once: the same bits, sooner.

A sum over two ranks is one addition per element, ``a + b``, and IEEE addition is
commutative, so the way a bucket is cut into collectives changes no bit of the result.
From three ranks on it would: gloo's ring adds each element in an order that follows its
chunk, that is its position in the collective's buffer, so there a bucket stays one
collective, as PyTorch's reducer launches it. Two all-reduces in flight run on the gloo
process group's two worker threads, so the additions and copies of one overlap the
transfers of the other. Measured on a 2-core machine, the bench's mlp (buckets of 4 and
6 MB) with both forms of xgrad's DDP and PyTorch's taking turns in the same processes:
the halves' step over the whole bucket's step 0.92-1.03, median 0.97, over six launches
of 120 steps (with and without ``find_unused_parameters``); a 10 MB all-reduce alone
8.8 ms in halves against 10.9 ms whole. Buckets of 1-2 MB gained nothing, nor did four
pieces over two.

Only the reducer's own all-reduce is cut (a communication hook sees PyTorch's buckets),
only on gloo (NCCL runs its own channels in parallel), and only from :data:`MIN_BYTES`:
below that a second collective's fixed cost outweighs the overlap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MIN_BYTES", "SPLIT_ENV", "Halves", "pieces", "wanted_pieces"]

#: environment variable that sets the pieces of a large bucket (``1``: never cut).
SPLIT_ENV = "XGRAD_DDP_SPLIT"

#: the smallest bucket, in bytes, that is cut.
MIN_BYTES = 2 << 20


def wanted_pieces() -> int:
    """The pieces a bucket that may be cut is cut into: ``$XGRAD_DDP_SPLIT``, else 2.

    Raises:
        ValueError: ``$XGRAD_DDP_SPLIT`` is not an integer >= 1.
    """
    env = os.environ.get(SPLIT_ENV)
    if env is None:
        return 2
    try:
        wanted = int(env)
    except ValueError:
        raise ValueError(f"{SPLIT_ENV}={env!r} is not a number of pieces") from None
    if wanted < 1:
        raise ValueError(f"{SPLIT_ENV}={env!r}: expected a number of pieces >= 1")
    return wanted


def pieces(buffer: torch.Tensor, wanted: int, world_size: int, backend: str) -> int:
    """How many concurrent all-reduces ``buffer`` (a bucket) is reduced by: ``wanted``
    where that gives the same bits and measured faster (the module docstring), else 1."""
    if (
        wanted == 1
        or world_size != 2
        or backend != "gloo"
        or buffer.is_complex()  # reduced as pairs of reals: kept whole, as before
        or buffer.is_sparse
        or buffer.numel() * buffer.element_size() < MIN_BYTES
    ):
        return 1
    return min(wanted, buffer.numel())


class Halves:
    """The pieces' works as one ``Work``: complete when every piece is, failed when any is.

    Its future completes with ``[buffer]``, as a single all-reduce's does, so a caller
    that chains on it sees no difference.
    """

    __slots__ = ("_buffer", "_works")

    def __init__(self, works: Sequence[Any], buffer: torch.Tensor) -> None:
        self._works = tuple(works)
        self._buffer = buffer

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> bool:
        for w in self._works:  # the first piece that failed raises, as one collective would
            w.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        buffer = self._buffer

        def whole(done: torch.futures.Future[Any]) -> list[torch.Tensor]:
            for piece in done.value():
                piece.value()  # a failed piece fails the whole
            return [buffer]

        futures = [w.get_future() for w in self._works]
        return torch.futures.collect_all(futures).then(whole)
