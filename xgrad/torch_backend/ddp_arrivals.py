"""Gradient arrivals recorded in C: one Python hook per bucket instead of one per gradient.

PyTorch's reducer hooks are C++; xgrad's were Python, one frame and a reducer call per
gradient (about 1 µs each, which decides the step time of models with many small
tensors). Once a backward pass has shown the order gradients arrive in, most small
parameters get ``list.append`` of an arrival log as their post-accumulate-grad hook: a
C builtin, so autograd records the parameter without running any Python. A Python hook
stays on every parameter that was the last of its bucket to arrive, on the first to
arrive (it starts the pass), on one that would be logged alone between two Python hooks
(its own hook costs less than a drain of one), and on every large or sparse one; each Python hook, and the
end-of-backward callback, first hands the logged parameters to the reducer
(:meth:`~xgrad.reducer.Reducer.mark_many`) in the order they arrived, so the reducer sees
exactly the marks one hook per gradient would have made, only later (at the bucket's
last gradient when the order holds, else at the next Python hook or the end of the pass:
a bucket is never launched before all its gradients are in).

The hooks are swapped in place in the parameter's own hook table, so their order among
other hooks never changes; DDP's hook is kept after every other one (where PyTorch's
reducer reads the gradient), moved to the end when the user adds one. A parameter is
only logged while DDP's hook is its only post-accumulate-grad hook (a later hook could replace ``.grad`` before the log is read):
when one is added, every parameter gets its Python hook back. A backward pass whose
hooks run in more than one autograd graph task (reentrant checkpointing) keeps the
Python hooks for good: the pass's end is queued from a hook, in that hook's graph task,
and an end queued inside a reentrant backward is put off until the next hook, of the
outer task, queues it again (:func:`.ddp_cut_short.put_off`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

#: a parameter of this many elements or more keeps its Python hook (its gradient is
#: copied into the bucket as it arrives, see :func:`xgrad.reducer_buckets.arrive`).
LOGGED_NUMEL = 1 << 14


class ArrivalLog:
    """Which parameters' hooks only log their arrival, and the log itself.

    Args:
        params: the reduced parameters, in the reducer's order.
        handles: the hook handles of DDP's Python hooks on them.
        python_hooks: those hooks.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        handles: Sequence[Any],
        python_hooks: Sequence[Callable[[torch.Tensor], None]],
    ) -> None:
        n = len(params)
        #: the parameters whose logging hook ran, in order, since the last drain.
        self.log: list[torch.Tensor] = []
        self._append = self.log.append
        self.index = {id(p): i for i, p in enumerate(params)}
        self._tables = [p._post_accumulate_grad_hooks for p in params]
        self._keys = [h.id for h in handles]
        self._python = list(python_hooks)
        self._eligible = [
            p.layout is torch.strided and p.numel() < LOGGED_NUMEL and len(t) == 1
            for p, t in zip(params, self._tables, strict=True)
        ]
        self.logged = [False] * n
        self.any_logged = False
        #: off for good (hooks in several graph tasks, or no parameter can be logged).
        self.enabled = any(self._eligible)
        self._hooks_counted = sum(map(len, self._tables))
        self.handles_made = RemovableHandle.next_id
        self._plan: Any = None
        self._order: Sequence[int] = ()

    def relayout(self, order: Sequence[int], unused: Sequence[int], plan: Any) -> None:
        """Log every small parameter but the first, each bucket's last to arrive, and lone ones.

        ``order`` and ``unused`` are the ready order and the parameters marked without
        a gradient of the pass that just ended; ``plan`` (a
        :class:`~xgrad.buckets.BucketPlan`) is what the next pass reduces with.
        """
        if not self.enabled or (plan is self._plan and order == self._order):
            return
        self._plan, self._order = plan, order
        skip = set(unused)
        arrived = [i for i in order if i not in skip]
        keep = [not e for e in self._eligible]
        if arrived:
            keep[arrived[0]] = True
        position = {i: n for n, i in enumerate(arrived)}
        for members in plan.buckets:
            seen = [i for i in members if i in position]
            if seen:
                keep[max(seen, key=position.__getitem__)] = True
        # A parameter logged alone between two Python hooks would cost a drain of one
        # (take, then mark_many) where its own Python hook costs less: it keeps its hook.
        for n, i in enumerate(arrived):
            if (
                not keep[i]
                and (n == 0 or keep[arrived[n - 1]])
                and (n + 1 == len(arrived) or keep[arrived[n + 1]])
            ):
                keep[i] = True
        self._set([not k for k in keep])

    def disable(self) -> None:
        """Every parameter gets its Python hook back, for good."""
        self.enabled = False
        self._set([False] * len(self.logged))

    def hooks_last(self, running: int = -1) -> bool:
        """Move DDP's hook after every other post-accumulate-grad hook where one was added.

        PyTorch's reducer reads a gradient after all of them (its hook is the gradient
        accumulator's post hook), so a hook of the user's that scales or replaces
        ``.grad`` is reduced, whenever it was registered. Any hook made anywhere takes a
        new handle id, so nothing is looked at while no hook was made since the last call.
        Parameter ``running``'s table is left alone (autograd is running its hooks);
        returns whether DDP's hook is already last there.
        """
        made = RemovableHandle.next_id
        if made == self.handles_made:
            return True
        last = True
        for i, (table, key) in enumerate(zip(self._tables, self._keys, strict=True)):
            if len(table) > 1 and next(reversed(table)) != key:
                if i == running:
                    last = False
                    continue
                table[key] = table.pop(key)  # autograd runs them in the dict's own order
        self.handles_made = made if last else -1  # -1: that table is still to be done
        return last

    def hooks_unchanged(self) -> bool:
        """Whether no post-accumulate-grad hook was added or removed since the layout."""
        return sum(map(len, self._tables)) == self._hooks_counted

    def _set(self, logged: list[bool]) -> None:
        for i, (old, new) in enumerate(zip(self.logged, logged, strict=True)):
            if old != new:
                self._tables[i][self._keys[i]] = self._append if new else self._python[i]
        self.logged = logged
        self.any_logged = any(logged)

    def take(self) -> tuple[list[int], list[Any]]:
        """The logged parameters' indices and gradients, in arrival order; the log empties."""
        index = self.index
        log = self.log
        taken = log[:]  # one C call: an append from another thread is kept for the next take
        del log[: len(taken)]
        return [index[id(p)] for p in taken], [p.grad for p in taken]
