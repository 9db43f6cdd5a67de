"""Where a pipeline step divides its gradients by m, as torch's schedules divide them.

torch 2.13's schedules (``scale_grads=True``) run each microbatch's backward from its
loss as it is and divide a stage's parameter gradients by m once per step, after the
stage's last backward (its last B, or its last W under zero bubble):
``_PipelineStageBase.scale_grads``, called by ``perform_reduce_grad`` at the stage's
REDUCE_GRAD, after FSDP's reduction there, or right after that last backward (a DDP stage
reduces within it). So the reduction comes first, then the division, and the gradients
sent upstream are the undivided loss's: each stage divides its own. Dividing each loss by
m before its backward (what this runtime did) is the same in exact arithmetic, not in
floating point where m is not a power of two (the last bits differ, about 6e-17 in
float64); divided as torch divides, the gradients equal torch's bit for bit.

Where torch does worse, this runtime does not:

- torch divides the whole ``.grad``, what earlier steps accumulated there too: several
  steps without ``zero_grad`` give an average that shrinks by m at each step (the
  gradient accumulation of torchtitan's issue 1733). Here what ``.grad`` held before the
  step is set aside (copied, and zeroed in place: a DDP's bucket views stay what they
  are) and added back after the division: ``.grad`` is what it held plus the step's
  gradient, as for the unpipelined model.
- A parameter that two partitions of a rank share is divided once, after the later (torch
  divides it at each of its stages).
- The step's own tensors that require grad (stage 0's batch, a keyword of the model, the
  targets, a ``loss_kwargs`` tensor) get the unpipelined model's gradient: each
  microbatch's is divided by m as it reaches them (torch leaves them m times that under B,
  and its zero-bubble W none to the targets). So does what a stage or the loss reads of
  them, or of what they were computed from, besides its arguments (the batch ``x`` a
  closure reads whole, an embedding taken before the step that the loss's projection is
  tied to): that is the step's data too (``pipeline_step_data``), divided as it is read
  (:meth:`StepScaling.divide_entries`). A parameter of a stage's (or the loss module's)
  divided at a point that they were computed from would be divided twice on that path,
  so it is refused (:meth:`StepScaling.begin`, ``more``); where m is a power of two each
  loss is divided before its backward, and it is right.
- A ``loss_fn`` that is a module with parameters (a learnt temperature, an adaptive
  softmax) has them divided with the last stage's (torch divides its stages' alone and
  leaves them m times the unpipelined model's, as this runtime did before it divided
  after the backward). Under zero bubble the last stage's W differentiates them with the
  stage's own (``StageState._params``; W from the joins its I pass finds, see
  ``pipeline_joins``): torch 2.13's W differentiates its stage's parameters alone, and
  its ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble leave their ``.grad`` None,
  as this runtime did (its ScheduleDualPipeV a part of the sum: 1.92 in a run where m = 4
  times the whole batch's is 2.12).
- A plain function that reads parameters of its own (a lambda closing over a learnt
  temperature, a ``functools.partial`` or bound method of a module that holds some, a
  stage's weight tied into the loss) has them treated as a loss module's: they are found
  in the loss's graph at each forward of the last stage (``pipeline_loss_params``) and
  join the division at the last stage's point (:meth:`StepScaling.more` for those a
  later microbatch reaches first). Before, they were not seen: under B m times the
  unpipelined model's gradient, under I and W none. So are the tensors a stage's forward
  reads without holding them (a module-level ``nn.Parameter``, another partition's
  weight), found in the stage's graph and divided at its partition's point (torch leaves
  them m times the unpipelined model's gradient under B, none under its zero-bubble W).

A step that fails puts back what it set aside: ``.grad`` then holds that plus the failed
step's partial, undivided gradients (zero them before retrying).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.autograd_graph import leaf_variables
from xgrad.torch_backend.pipeline_step_data import Entries, hook_entries
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["StepScaling", "scale_points"]

#: the passes that add to the parameters' ``.grad`` (I computes the inputs' alone).
_ADDING = (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)


def scale_points(
    actions: Sequence[Action], slot_of: dict[int, int], reduce_at: dict[int, int], reduces: bool
) -> dict[int, int]:
    """Partition index -> the position in ``actions`` after which its gradients are
    divided: its REDUCE_GRAD that reduces (``reduce_at``, when ``reduces``), after the
    reduction as torch's ``perform_reduce_grad``; else its last B or W."""
    points: dict[int, int] = {}
    for i, a in enumerate(actions):
        slot = slot_of.get(a.stage)
        if slot is None:
            continue
        if a.kind in _ADDING or (
            reduces and a.kind is Kind.REDUCE_GRAD and reduce_at.get(slot) == a.stage
        ):
            points[slot] = i
    return points


class StepScaling:
    """One training step's division by ``m`` of the gradients of this rank's
    ``partitions``, after the actions :func:`scale_points` gives (``points``).

    :meth:`begin` runs before the step's first backward, :meth:`after` after each action
    that may be a point, :meth:`abandon` when the step fails.
    """

    def __init__(
        self,
        m: int,
        actions: Sequence[Action],
        points: dict[int, int],
        partitions: Sequence[nn.Module],
        extra: tuple[int, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.m = m
        # (point, tensors) before begin: the loss_fn's parameters at the last stage's point
        # (``extra``), then what a stage or its loss reads of its own (more)
        self._pending: list[tuple[int, Sequence[torch.Tensor]]] = [] if extra is None else [extra]
        self._actions = actions
        self._points = points
        self._partitions = partitions
        self._due: dict[Action, list[torch.Tensor]] | None = None  # set by begin
        self._owner: dict[int, tuple[int, torch.Tensor]] = {}  # id(p): its point, p
        self._end = actions[max(points.values())] if points else None
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, its .grad
        self._hooks: list[RemovableHandle] = []
        self._upstream: set[int] = set()  # ids of the leaves the step's own tensors reach
        self._token = object()  # marks the nodes this step hooked (divide_entries)

    def begin(self, step_tensors: Any) -> None:
        """Before the step's first backward (once; later calls return at once): the
        parameters' gradients set aside, and the tensors of ``step_tensors`` (a pytree:
        the step's own inputs, keywords, targets and ``loss_kwargs``, as its microbatches
        see them) that require grad divide what reaches them by m."""
        if self._due is not None:
            return
        # Each parameter once, at the later of its partitions' points (read each step:
        # a module's parameters may change between steps).
        owner = self._owner
        groups: list[tuple[int, Iterable[torch.Tensor]]] = [
            (at, self._partitions[slot].parameters()) for slot, at in self._points.items()
        ]
        groups += self._pending
        self._pending = []
        for at, params in groups:
            for p in params:
                seen = owner.get(id(p))
                if seen is None or seen[0] < at:
                    owner[id(p)] = (at, p)
        hooked: dict[int, torch.Tensor] = {}
        for t in tensor_leaves(step_tensors):
            if t.requires_grad:
                hooked.setdefault(id(t), t)
        self._upstream = _leaves_below(hooked.values())
        self._refuse_twice(p for _, p in owner.values())
        self._due = {}
        for at, param in owner.values():
            self._due.setdefault(self._actions[at], []).append(param)
            self._set_aside(param)
        for t in hooked.values():
            self._hooks.append(t.register_hook(self._divided))

    def _refuse_twice(self, params: Iterable[torch.Tensor]) -> None:
        """A tensor divided at a point that the step's own tensors were computed from (a
        weight of the loss's tied to an embedding computed before the step): what reaches
        it through them is divided by their hooks already, and again at its point."""
        for p in params:
            if id(p) in self._upstream:
                raise ValueError(
                    f"the step's inputs, keywords, targets or loss_kwargs are, or were "
                    f"computed from, a tensor of shape {tuple(p.shape)} ({p.dtype}) that a "
                    f"stage or the loss reads as its own: with m = {self.m} microbatches, "
                    "not a power of two, its gradient is divided by m after the step's "
                    "last backward, and what reaches it through them, divided as it "
                    "reaches them, would be divided twice; compute them inside the stages "
                    "(or the loss), give them detached, or take m a power of two (each "
                    "microbatch's loss is then divided before its backward)"
                )

    def _set_aside(self, param: torch.Tensor) -> None:
        if param.grad is not None and id(param) not in self._saved:
            with torch.no_grad():
                self._saved[id(param)] = (param, param.grad.clone())
                param.grad.zero_()

    def more(self, found: Sequence[torch.Tensor], at: int) -> None:
        """Tensors a stage or its loss reads of its own, found at one of its forwards
        (``pipeline_loss_params``): divided at ``at``, its partition's point (the last
        stage's for the loss's). Found after :meth:`begin`, a new one is set aside now (it
        has none of the step's gradient yet: a graph of this step reaches it first at that
        forward, before its backward), or moved to ``at`` where it was due earlier: what
        it held before the step was set aside at begin, and what it holds now is this
        step's (a partition's parameter that an earlier stage reads late), kept."""
        if self._due is None:  # begin takes them with the rest
            self._pending.append((at, list(found)))
            return
        self._refuse_twice(found)
        for p in found:
            seen = self._owner.get(id(p))
            if seen is not None and seen[0] >= at:
                continue
            if seen is not None:
                before = self._due[self._actions[seen[0]]]
                before[:] = [q for q in before if q is not p]
            else:
                self._set_aside(p)
            self._owner[id(p)] = (at, p)
            self._due.setdefault(self._actions[at], []).append(p)

    def _divided(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.m

    def divide_entries(self, entries: Entries) -> None:
        """What a stage or its loss reads of the step's data without a step tensor's hook
        on the way (``pipeline_step_data``: ``x`` read whole, its microbatches hooked):
        each node's edges there divide their gradient by m, as the hooks divide theirs,
        until the step ends (a node that several microbatches' graphs share, hooked
        once)."""
        self._hooks += hook_entries(entries, self.m, self._token)

    def after(self, action: Action) -> None:
        """After ``action``: the gradients due there divided by m, as torch's
        ``scale_grads`` divides them (``p.grad.div_(m)``: the same operation, on every
        device), then what ``.grad`` held before the step added back."""
        params = None if self._due is None else self._due.get(action)
        if params is not None:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(self.m)
                    kept = self._saved.pop(id(p), None)
                    if kept is not None:
                        _add_back(p, kept[1])
        if action == self._end:
            self._unhook()

    def abandon(self) -> None:
        """The step failed (or another begins): what was set aside is added back, undivided
        gradients and all, and the step's tensors lose their hooks."""
        with torch.no_grad():
            for p, kept in self._saved.values():
                _add_back(p, kept)
        self._saved.clear()
        self._unhook()

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _add_back(p: Any, kept: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = kept
    elif p.grad.is_sparse and not kept.is_sparse:
        p.grad = kept.add_(p.grad)
    else:
        p.grad.add_(kept)


def _leaves_below(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The ids of the leaves ``tensors`` (the step's own, that require grad) are or were
    computed from: where their gradients go (nothing to walk for a leaf batch)."""
    tensors = list(tensors)
    ids = {id(t) for t in tensors if t.grad_fn is None}
    return ids | {id(v) for v in leaf_variables(t.grad_fn for t in tensors)}
