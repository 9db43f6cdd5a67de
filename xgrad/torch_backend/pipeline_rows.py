"""How a step's batch splits into microbatches: torch's ``tensor_split``, uneven ones too.

torch 2.13's schedules split every tensor with ``torch.tensor_split(t, m, dim)``
(``torch.distributed.pipelining.microbatch``): 10 rows into 4 microbatches are 3, 3, 2, 2,
the larger ones first; a multiple of m splits as ``chunk`` does. Every rank computes the
same sizes from a batch size and m, so the last stage's targets (split on its rank) pair
with the inputs stage 0's rank split, when the two batches are as large (else the last
stage's loss names the microbatch whose output and target rows differ). No size travels:
a forward message says its layout where its microbatch's differs from the last step's
(:mod:`~xgrad.torch_backend.pipeline_comm`), and a gradient's receive is sized from the
output its forward made.

Each microbatch's gradient counts 1/m whatever its size, as torch's schedules divide the
gradients (checked on torch 2.13, on one stage, where its uneven microbatches run): with a
loss that is a mean over its microbatch, a row of a 2-row microbatch then weighs 1/8 and
one of a 3-row microbatch 1/12 (10 rows, m = 4), and the loss the runtime's ``step``
returns is the mean of the microbatches' losses, not the whole batch's. torch's own stages
on several ranks fail on them: each receive buffer is sized from microbatch 0, the last
stage computes a 2-row microbatch's loss on 3 rows, and stage 0's backward fails on its
gradient.

Where torch goes wrong, a ``ValueError`` naming the value and the rank, raised before the
rank sends anything:

* fewer rows than microbatches: torch makes fewer microbatches and its schedule refuses
  them (``Expecting 4 arg_mbs but got 3`` on stage 0's rank, ``Tensor size 3 is smaller
  than num_chunks`` on the last stage's), each rank alone, its peers left waiting;
* two tensors of one rank split unevenly into different sizes (inputs of 10 rows, a keyword
  of 9: 3, 3, 2, 2 and 3, 2, 2, 2): torch pairs rows that do not belong together without a
  word. Sizes that are all multiples of m split alike in proportion, as they always did.
"""

from __future__ import annotations

import torch

__all__ = ["Rows", "check_rows", "microbatch_sizes", "split_rows"]

#: per split tensor, what it is (as an error names it) and its size along its split dim.
Rows = list[tuple[str, int]]


def microbatch_sizes(size: int, m: int) -> list[int]:
    """The sizes of ``size`` rows split into m microbatches, as ``tensor_split`` splits."""
    return [size // m + (k < size % m) for k in range(m)]


def split_rows(
    leaf: torch.Tensor, m: int, dim: int, what: str, rank: int, rows: Rows | None
) -> list[torch.Tensor]:
    """``leaf`` as m microbatches along ``dim`` (views, as torch's), its size noted in
    ``rows``. ``what`` names it with its size: ``"inputs batch size 10"``.

    Raises:
        ValueError: fewer rows than microbatches (an empty microbatch would run every stage
            on nothing, and torch's schedules refuse it).
    """
    size = leaf.shape[dim]
    if size < m:
        raise ValueError(
            f"rank {rank}: {what} is smaller than the {m} microbatches: every microbatch "
            f"needs at least one row (give at least {m}, or fewer microbatches)"
        )
    if rows is not None:
        rows.append((what, size))
    return list(torch.tensor_split(leaf, m, dim))


def check_rows(rows: Rows, m: int, rank: int) -> None:
    """Refuse tensors of one rank whose microbatches would not pair row for row.

    Raises:
        ValueError: a tensor split unevenly, and another of another size (naming both).
    """
    uneven = next(((what, size) for what, size in rows if size % m), None)
    if uneven is None:
        return
    for what, size in rows:
        if size != uneven[1]:
            raise ValueError(
                f"rank {rank}: {uneven[0]} and {what} split into microbatches of different "
                f"rows ({microbatch_sizes(uneven[1], m)} and {microbatch_sizes(size, m)}): "
                "microbatch k would pair rows that do not belong together; give them the "
                f"same batch size (or both multiples of the {m} microbatches)"
            )
