"""REDUCE_GRAD with ``dp_group``: a partition's gradients averaged over the replicas.

One flat all-reduce per dtype (so no gradient is rounded through another dtype). Every
parameter takes part, with zeros where this replica has no gradient, and a count of the
replicas that have one travels at the end of the flat tensor: replicas whose graphs
differ by their data (a branch taken on one only) then still reduce tensors of the same
size, and a parameter gets a gradient where any replica has one (``None`` stays only where
no replica has one), as DDP with ``find_unused_parameters`` gives it.

The last stage's reduction averages the loss's parameters too, as the unpipelined
data-parallel model's: a loss module's with the stage's (every replica lists the same),
then the tensors a loss function reads of its own (``pipeline_loss_params``), which each
replica finds in its loss's graph; every stage's averages the tensors its forward reads
without holding them (a module-level parameter), found in the stage's graph. Those could
differ between replicas whose losses or stages take another branch on their data, and
all-reduces of different sizes do not fail, they abort the process (gloo) or pair the
wrong tensors; so a small integer all-reduce of a digest of their dtypes and shapes goes
first (at every stage's reduction: a replica cannot know that none found any), and
replicas that found different ones are refused by name, on every replica, before any of
their gradients is sent. The order they are found in depends on the data too (a head
picked by the target: a then b on one replica, b then a on another), so they are sent in
the order of where the loss function (or the stage's module) holds them
(``pipeline_loss_order``), which the digest covers.

What the step was given on this rank, and what that was computed from, is this replica's
data, not averaged (``pipeline_step_data``); any other tensor read is taken as a weight,
which the replicas share: one whose values differ between them (a replica's batch that a
closure reads on a rank not given it) cannot be told from data, and is refused by
shape, on every replica, rather than averaged. A second digest, of its values (their
checksums, ``pipeline_checksum``: the same on every replica where the values are), goes
with the first; where the replicas' differ, one more all-reduce says which tensors differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from xgrad.torch_backend.pipeline_checksum import checksums
from xgrad.torch_backend.pipeline_loss_order import in_order

__all__ = ["average_grads"]


def average_grads(
    dp: Any,
    size: int,
    what: str,
    params: Sequence[torch.Tensor],
    found: Sequence[torch.Tensor] | None = None,
    device: torch.device | None = None,
    holder: Any = None,
    reader: str = "the loss",
) -> None:
    """Average ``params``' gradients over the data-parallel steps ``dp``'s group (``size``
    replicas) at ``what`` (the REDUCE_GRAD action); then, where ``found`` is given (the
    tensors ``reader``, a stage's forward or its loss, reads of its own that ``holder``,
    the loss function or the stage's module, may hold; maybe none), theirs, once every
    replica is known to have found the same, in the same order (a digest all-reduced on
    ``device``).

    Raises:
        ValueError: the replicas found different tensors in their losses, or tensors that
            no replica can tell apart from each other.
    """
    launched = _launch(params, dp)
    digest = None
    if found is not None:
        found, keys, alike = in_order(found, holder)
        sums = checksums(found)
        mine, values = _digest(keys), _digest(sums)
        # The maximum of each and of its negation: every replica's is the same iff the two
        # give the same number (a 62-bit digest, where a sum of squares would overflow).
        digest = torch.tensor([mine, -mine, values, -values], dtype=torch.int64, device=device)
        digest_work = dist.all_reduce(digest, op=dist.ReduceOp.MAX, group=dp.group(), async_op=True)
    _finish(launched, dp, size, what)
    if digest is not None and found is not None:
        dp.wait(digest_work, f"{what} (the tensors {reader} reads)", digest.is_cuda)
        high, low, value_high, value_low = digest.tolist()
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in found) or "none"
        if high != -low:
            raise ValueError(
                f"{what}: in the data-parallel replicas, {reader} reached different "
                f"tensors of their own (this replica's: {shapes}): what a loss function or "
                "a stage's forward reads without holding it as a parameter (a closure's, "
                "a bound module's) is averaged over dp_group with the stage's parameters, "
                "so every replica must read the same ones at each step (read them on every "
                "microbatch, or make them the loss module's or the stage's parameters; a "
                "replica's data read so must be given to step() on that rank on every "
                "replica alike)"
            )
        if alike:  # the same on every replica (the digest covers it): all refuse
            raise ValueError(
                f"{what}: {reader} reached tensors of its own of the same dtype and "
                f"shape that it does not hold as Python objects ({shapes}): the "
                "data-parallel replicas, which may reach them in another order, cannot "
                "tell which is which to average them; make them the loss module's or the "
                "stage's parameters, or name them where they are read (the loss "
                "function's closure, a default, a global, a partial's argument, its "
                "module; an attribute of the stage's module, a global its class's "
                "methods name)"
            )
        if value_high != -value_low:  # the same on every replica, and what follows too
            _refuse_unlike(found, sums, dp, device, what, reader)
        if found:
            _finish(_launch(found, dp), dp, size, what)


def _refuse_unlike(
    found: Sequence[torch.Tensor],
    sums: list[int],
    dp: Any,
    device: torch.device | None,
    what: str,
    reader: str,
) -> None:
    """Some tensor ``reader`` reads of its own differs between the replicas (``sums``,
    this replica's checksums): which ones, told every replica by one more all-reduce
    (every replica found the same tensors, so it has the same size), and refused."""
    both = torch.tensor([*sums, *(-c for c in sums)], dtype=torch.int64, device=device)
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dp.group(), async_op=True)
    dp.wait(work, f"{what} (the values of the tensors {reader} reads)", both.is_cuda)
    top = both.tolist()
    k = len(sums)
    unlike = [t for i, t in enumerate(found) if top[i] != -top[k + i]]
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in unlike)
    raise ValueError(
        f"{what}: {reader} reads tensors of its own whose values differ between the "
        f"data-parallel replicas ({shapes}): neither one weight that the replicas share "
        "(its gradient would be averaged over dp_group) nor known as this replica's data "
        "(its gradient left to the replica). If it is the replica's data (its batch, or "
        "a tensor computed from it), give it to step() on this rank, as its inputs, "
        "targets, a keyword or a loss_kwargs tensor (the step's tensors, and the leaves "
        "they were computed from, are the replica's data, on a rank that does not split "
        "them too); if it is a weight, start every replica from the same values"
    )


def _digest(keys: Sequence[Any]) -> int:
    """0 for none, else 1 + 62 bits of a hash of what each is known by, in order."""
    if not keys:
        return 0
    code = hashlib.blake2b(repr(list(keys)).encode(), digest_size=8).digest()
    return 1 + (int.from_bytes(code, "big") >> 2)


def _launch(params: Sequence[torch.Tensor], dp: Any) -> list[Any]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    launched = []
    for dtype, group in by_dtype.items():
        parts = [
            _dense(p.grad).reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
            for p in group
        ]
        parts.append(
            torch.tensor([p.grad is not None for p in group], dtype=dtype, device=parts[0].device)
        )
        flat = torch.cat(parts)
        work = dist.all_reduce(flat, group=dp.group(), async_op=True)
        launched.append((group, flat, work))
    return launched


def _finish(launched: list[Any], dp: Any, size: int, what: str) -> None:
    for params, flat, work in launched:
        dp.wait(work, f"{what} (all-reduce)", flat.is_cuda)
        counts = flat[-len(params) :].tolist()
        values = flat[: -len(params)]
        values /= size
        start = 0
        for p, count in zip(params, counts, strict=True):
            mean = values[start : start + p.numel()].view_as(p)
            start += p.numel()
            if count == 0:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(mean)  # the parameter's layout
            elif p.grad.is_sparse:
                p.grad = mean.to_sparse(p.grad.sparse_dim())
            else:
                p.grad.copy_(mean)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad
