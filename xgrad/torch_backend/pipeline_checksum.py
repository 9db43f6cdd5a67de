"""Checksums of tensors' values that are equal on every data-parallel replica where the
values are, bit for bit, and differ where they differ (``pipeline_average`` refuses a
tensor read as a weight whose values differ between the replicas: a replica's batch).

Each checksum is a sum of the tensor's bytes, read as 64-bit integer words, each word
times a weight given by its position, modulo 2**64 (torch's int64 arithmetic wraps): exact,
so the same whatever the order of the additions, the threads or the device. A plain sum of
the words would be blind to where they are: the rows of a batch in another order, one-hot
rows of other classes (every row one word of 1.0), or 1.0 and 2.0 against 0.5 and 4.0
(their float32 words sum alike) all gave equal sums, and a replica's batch read without
being given passed for a weight and was averaged. The words are taken as rows of a prime
width (the rows of a batch of any power-of-two width fall across its columns); a word's
weight is its column's plus its row's, pseudo-random odd numbers, so two passes over the
tensor (the column sums, the row sums) weigh every word, where summing 32-bit words into
int64 (the widening reduction) took ten times a float sum's time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["checksums"]

#: words a row: a prime
_WIDTH = 1021
#: 2**64 / golden ratio, as a signed int64 (odd): spreads consecutive integers
_MIX = -7046029254386353131
#: where the weights of the rows, and of the words left after the last whole row, begin
_ROWS, _REST = 1 << 40, 1 << 50


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """One checksum of each tensor's values (62 bits: a replica's maximum of it and of its
    negation tells whether every replica's is the same), on the device of the first."""
    if not tensors:
        return []
    device = tensors[0].device
    found = torch.stack([_checksum(t).to(device) for t in tensors])
    return [c & ((1 << 62) - 1) for c in found.tolist()]


def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` pseudo-random odd int64 weights, the ``start``-th on (the same on any device)."""
    w = (torch.arange(start, start + n, dtype=torch.int64, device=device) + 1) * _MIX
    return (w ^ (w >> 29)) | 1


def _checksum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if not flat.is_contiguous() or flat.storage_offset() * flat.element_size() % 8:
        flat = flat.clone()  # (a view its 64-bit words cannot be read from in place)
    raw = flat.view(torch.uint8)
    cut = raw.numel() // 8 * 8
    words = raw[:cut].view(torch.int64)
    n, device = words.numel(), words.device
    rows = n // _WIDTH
    body, rest = words[: rows * _WIDTH].view(rows, _WIDTH), words[rows * _WIDTH :]
    total = (body.sum(0) * _weights(0, _WIDTH, device)).sum()
    total += (body.sum(1) * _weights(_ROWS, rows, device)).sum()
    total += (rest * _weights(_REST, rest.numel(), device)).sum()
    if cut < raw.numel():  # the last bytes (an odd float32, say): one word, zeros after
        last = torch.zeros(8, dtype=torch.uint8, device=device)
        last[: raw.numel() - cut] = raw[cut:]
        total += last.view(torch.int64)[0] * _weights(_REST + _WIDTH, 1, device)[0]
    return total
