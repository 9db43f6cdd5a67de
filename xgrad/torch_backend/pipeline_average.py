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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from xgrad.torch_backend.pipeline_loss_order import Key, in_order

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
        mine = _digest(keys)
        # The maximum of each and of its negation: every replica's is the same iff the two
        # give the same number (a 62-bit digest, where a sum of squares would overflow).
        digest = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        digest_work = dist.all_reduce(digest, op=dist.ReduceOp.MAX, group=dp.group(), async_op=True)
    _finish(launched, dp, size, what)
    if digest is not None and found is not None:
        dp.wait(digest_work, f"{what} (the tensors {reader} reads)", digest.is_cuda)
        high, low = digest.tolist()
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in found) or "none"
        if high != -low:
            raise ValueError(
                f"{what}: in the data-parallel replicas, {reader} reached different "
                f"tensors of their own (this replica's: {shapes}): what a loss function or "
                "a stage's forward reads without holding it as a parameter (a closure's, "
                "a bound module's) is averaged over dp_group with the stage's parameters, "
                "so every replica must read the same ones at each step (read them on every "
                "microbatch, or make them the loss module's or the stage's parameters)"
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
        if found:
            _finish(_launch(found, dp), dp, size, what)


def _digest(keys: Sequence[Key]) -> int:
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
