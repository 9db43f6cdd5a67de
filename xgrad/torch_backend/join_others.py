"""Under xgrad's ``Join``: the hooks of joinables that are not DDPs, run once per step.

PyTorch's ``Join`` runs every joinable's join hook once per count of the ranks still
training, and a DDP counts at each of its forward passes. A ``ZeroRedundancyOptimizer``
listed after the DDP (PyTorch's recipe for uneven inputs, ``Join([ddp, opt])``) then
steps on a joined rank once per forward pass, while the ranks still training step once
per iteration: where an iteration runs more than one forward pass (a ``no_sync``
accumulation, an evaluation under ``torch.no_grad()``), the joined rank's broadcasts of
its shards meet the next collectives of the ranks still training. PyTorch's own DDP and
``Join`` hang there to gloo's timeout (probed: 60 s), and xgrad's DDP raised its timeout
naming a rank that had done nothing wrong. And where a step fails and the user's loop
gives up the rest of its iteration (the optimizer step with it), the joined rank still
shadowed that optimizer step.

So under xgrad's ``Join`` whose first joinable is xgrad's DDP, the hook of each other
joinable that is not a DDP runs only in an iteration where the DDP's hook shadowed a
backward pass (the step the optimizer follows), and not where that step failed: once
per step, as the ranks still training call ``opt.step()``. A loop that steps its
optimizer more often than it runs a backward pass through the DDP, or that catches a
failed step and still steps, is outside this rule. Other orders (the optimizer first,
which then counts at its own ``step()``) keep PyTorch's rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.algorithms.join import JoinHook

from xgrad.torch_backend.join_hook import DDPJoinHook

__all__ = ["OncePerStep", "once_per_step"]


class OncePerStep(JoinHook):
    """A joinable's own hook, whose main hook runs once per step of the first DDP."""

    def __init__(self, hook: JoinHook, order: Any) -> None:
        self.hook = hook
        self.order = order  #: the context's :class:`~.join_order.JoinOrder`
        super().__init__()

    def main_hook(self) -> None:
        if self.order.stepped and not self.order.failed:
            self.hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.hook.post_hook(is_last_joiner)


def once_per_step(hooks: list[Any], joinables: Sequence[Any], order: Any) -> None:
    """Wrap, in ``hooks`` (the context's, in place), each hook that is not a DDP's in
    :class:`OncePerStep`, where the first of ``joinables`` is xgrad's DDP in ``order``."""
    if not joinables or getattr(joinables[0], "_join_order", None) is not order:
        return
    for i, hook in enumerate(hooks):
        if not isinstance(hook, (DDPJoinHook, OncePerStep)):
            hooks[i] = OncePerStep(hook, order)
