"""How a rank's pass adds up its leaves' gradients, and runs their tensor hooks on the sum.

The context keeps each leaf's gradient: a private copy, unless only the pass holds it;
with ``accumulate_grad`` it is also added into ``.grad``, as PyTorch's AccumulateGrad does.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from xgrad.engine import Engine
from xgrad.torch_backend.dist_hooks import accumulator_hooks

__all__ = [
    "Accumulate",
    "add_into",
    "add_to_grad",
    "keep",
    "leaf_hooks",
    "post_accumulate_hooks",
]


def _count_refs(value: Any) -> int:
    return sys.getrefcount(value)


def _refs_of_a_local_passed_on() -> int:
    """``sys.getrefcount`` inside a function called with a local nothing else holds."""
    value = object()
    return _count_refs(value)


def _alone() -> int:
    """What torch counts for a storage that one tensor holds, asked as ``private`` asks:
    2 where the storage object made to ask holds a reference of its own (torch 2.13), 1
    where it does not (torch 2.6); a literal would take an aliased gradient for a private
    one on the releases that count 1."""
    t = torch.empty(1)
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


_ALONE = _alone()


class Accumulate:
    """How the engine adds a leaf's gradients: the first one is kept as it is, for now.

    One gradient tensor may reach several leaves, so each leaf gets a private copy, made
    after the pass (:meth:`private`): copying during the pass would delay the gradients
    this rank still sends (the engine runs accumulators first). A first gradient that
    nothing else can see is kept without a copy, as PyTorch's ``AccumulateGrad`` steals
    a gradient nobody else holds: the copy (a fresh 256 KB tensor is page faults more
    than copying) is 50-130 us per leaf on the bench's ranks.
    """

    #: ``sys.getrefcount`` of a gradient at the call of :meth:`private` in
    #: :func:`keep` (which pops it from the pass's results first) when nothing
    #: else holds it: the caller's variable, the argument (and the count's own, on
    #: interpreters that count it). Measured on the same call shape, not assumed.
    REFS = _refs_of_a_local_passed_on()

    def __init__(self) -> None:
        self.shared: dict[int, int] = {}  # id of a first gradient -> leaves it went to

    def __call__(self, old: Any, new: Any) -> Any:
        if old is None:
            self.shared[id(new)] = self.shared.get(id(new), 0) + 1
            return new
        return old + new

    def private(self, grad: Any, leaf: torch.Tensor | None = None) -> Any:
        """``grad`` for the context to keep: a copy unless only this pass holds it.

        Kept as it is only when it went to this leaf alone, the leaf has no tensor
        hooks (a hook may have kept it or a view of it), and nothing else references
        it: not a view, no other tensor on its storage, no other C++ or Python owner.
        """
        n = self.shared.get(id(grad))
        if n is None:  # a sum made by the pass: nobody else has it
            return grad
        if grad.layout != torch.strided:  # sparse (``nn.Embedding(sparse=True)``): no storage
            return grad.detach().clone()
        if (
            n == 1
            and leaf is not None
            and not leaf._backward_hooks
            and grad._base is None
            and not grad.requires_grad
            and grad._use_count() == 1
            # no tensor but the gradient on its storage (what that counts is measured)
            and torch._C._storage_Use_Count(grad.untyped_storage()._cdata) <= _ALONE
            and sys.getrefcount(grad) <= self.REFS
        ):
            return grad
        return grad.detach().clone()


def leaf_hooks(engine: Engine, leaf: torch.Tensor, node_hooks: Any = None) -> Any:
    """Run the leaf's tensor hooks (``leaf.register_hook``) on its summed gradient; then,
    with ``node_hooks`` (the pre- and post-hook dicts of its ``AccumulateGrad``), as
    PyTorch's distributed engine runs them where it takes a leaf's gradient: the
    pre-hooks, which may replace it, then the post-hooks, given no results."""

    def run(param: int, grad: Any) -> None:
        if grad is None:
            # Nothing reached the leaf (a recv whose gradient was not needed answered
            # its send with none): torch calls no hook then, and the leaf has no gradient.
            return
        for hook in list((leaf._backward_hooks or {}).values()):
            out = hook(grad)
            if out is not None:
                grad = out
        if node_hooks is not None:
            grad = accumulator_hooks(node_hooks[0], node_hooks[1], grad)
        engine.grads[param] = grad

    return run


def add_to_grad(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``leaf.grad`` as AccumulateGrad does (under ``no_grad``): a new
    ``.grad`` in the leaf's layout (a copy: the context keeps ``grad``; a sparse gradient
    stays sparse), else added in (:func:`add_into`)."""
    if leaf.grad is None:
        sparse = grad.layout != torch.strided
        leaf.grad = grad.clone() if sparse else torch.empty_like(leaf).copy_(grad)
    else:
        leaf.grad = add_into(leaf.grad, grad)


def add_into(total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``total + grad``, in ``total`` where it can be, as AccumulateGrad adds: a sparse
    total takes a sparse gradient in place, and becomes dense (a new tensor) with a
    dense one, which cannot be added into a sparse tensor."""
    if total.layout != torch.strided and grad.layout == torch.strided:
        return grad + total
    return total.add_(grad)


def post_accumulate_hooks(leaves: list[torch.Tensor]) -> None:
    """Run each leaf's ``register_post_accumulate_grad_hook`` hooks, in registration order.

    Called once per pass, after every leaf's ``.grad`` was written (PyTorch's AccumulateGrad
    runs them right after writing ``.grad``, so a hook that steps the leaf, as an
    optimizer in backward does, sees this pass's gradient).
    """
    for leaf in leaves:
        for hook in list((leaf._post_accumulate_grad_hooks or {}).values()):
            hook(leaf)


def keep(
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]],
    grads: dict[int, Any],
    leaves: tuple[torch.Tensor, ...],
    accumulate: Accumulate,
    accumulate_grad: bool,
) -> None:
    """Add a pass's leaf gradients (leaf index -> gradient, taken out of ``grads``) into
    the context's ``kept`` (id of leaf -> ``(leaf, gradient)``) and, with
    ``accumulate_grad``, into ``.grad``; then run the post-accumulate-grad hooks."""
    hooked: list[torch.Tensor] = []
    with torch.no_grad():
        for i in list(grads):
            grad = grads.pop(i)  # only this frame holds it now: see Accumulate.private
            leaf = leaves[i]
            old = kept.get(id(leaf))
            # In place, as PyTorch's context accumulates: a dict get_gradients returned
            # sees a later pass of the same context.
            total = accumulate.private(grad, leaf) if old is None else add_into(old[1], grad)
            kept[id(leaf)] = (leaf, total)
            if accumulate_grad:
                add_to_grad(leaf, grad)
                if leaf._post_accumulate_grad_hooks:
                    hooked.append(leaf)
        post_accumulate_hooks(hooked)
