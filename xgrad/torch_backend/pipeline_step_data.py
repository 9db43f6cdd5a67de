"""Which tensors a pipeline step's stages and loss read are this replica's data, not weights.

A loss function or a stage's forward may read a tensor it is not given as an argument:
a learnt temperature, a weight of another partition (``pipeline_loss_params`` finds
them), but also the step's own batch, say ``x`` in a closure that adds a reconstruction
term, or a tensor computed from it. A weight's gradient is divided by m with the stage's
parameters and averaged over ``dp_group``; data's is not averaged: data-parallel training
(DDP, or the unpipelined model on each replica) leaves an input's gradient on its replica,
each microbatch's divided by m as it reaches it, as the step's arguments get theirs
(``pipeline_scale``). Averaged, the replicas' inputs got the mean of theirs.

The rule: a tensor that requires grad is this replica's data when it is one of the tensors
the step was given on this rank (its inputs, targets, keywords and ``loss_kwargs``, whole
or as the microbatches; inputs and targets count on a rank that does not split them too,
that of a stage other than the first or last), or a leaf they were computed from (in
their graph upstream). Nothing else tells them apart (a closure holds a batch as it holds
a temperature), so any other tensor a stage reads of its own is taken as a weight, and
``pipeline_average`` refuses one whose values differ between the replicas (a weight's are
the same on every replica; a batch's are not) rather than average it: the case where a
rank reads its replica's data without having been given it.

:class:`StepData` holds the graph of this rank's data (its nodes: the grad_fns the given
tensors were computed through and their leaves' ``AccumulateGrad``), and
``pipeline_shared_graph.walk`` walks a stage's graph from its outputs or its loss without
going into it:
the leaves it meets are the stage's own, and each edge by which it enters that graph is
a read of the data. Where the gradients are divided after the step (m not a power of
two), an edge that no hook of a step tensor divides (``x`` read whole while its
microbatches are hooked) gets its node's hook, that divides what goes along it by m
(:meth:`~xgrad.torch_backend.pipeline_scale.StepScaling.divide_entries`); and a stage
that reads data runs its whole backward under zero bubble, as one given a batch that
requires grad (``StageSettings._takes_batch_grad``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["Entries", "StepData", "hook_entries"]

#: a node's ``metadata`` key: the step whose hook divides some of its edges
_HOOKED = "xgrad.pipeline_step_data"

#: a graph node -> the indices of its inputs (``next_functions``) that are the step's data
Entries = dict[Any, list[int]]


def _requiring(trees: Iterable[Any]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for tree in trees:
        if isinstance(tree, torch.Tensor):
            leaves = [tree]
        elif tree is None:
            continue
        else:
            leaves = tensor_leaves(tree)
        for t in leaves:
            if t.requires_grad:
                found.setdefault(id(t), t)
    return list(found.values())


class StepData:
    """The graph of this rank's data in one step (:meth:`of`): ``tensors``, the step's
    that require grad, and among them ``hooked``, those whose hooks divide what reaches
    them by m."""

    def __init__(self, tensors: list[torch.Tensor], hooked: list[torch.Tensor]) -> None:
        # The nodes themselves, held through the step: a leaf's AccumulateGrad lives while
        # something holds it, so the graphs built later link these very objects.
        self.nodes: set[Any] = set()
        todo = [get_gradient_edge(t).node for t in tensors]
        while todo:
            node = todo.pop()
            if node in self.nodes:
                continue
            self.nodes.add(node)
            todo += [child for child, _ in node.next_functions if child is not None]
        #: (node, output) whose gradient a step tensor's hook divides already
        self.covered: set[tuple[Any, int]] = set()
        for t in hooked:
            edge = get_gradient_edge(t)
            self.covered.add((edge.node, edge.output_nr))

    @classmethod
    def of(cls, given: Iterable[Any], hooked: Iterable[Any]) -> StepData | None:
        """The step's data: ``given``, pytrees of what the step was given on this rank
        (whole or split), and ``hooked``, its microbatches' tensors that
        ``StepScaling.begin`` hooks; ``None`` where none requires grad."""
        tensors = _requiring(given)
        more = _requiring(hooked)
        return cls([*tensors, *more], more) if tensors or more else None


def hook_entries(entries: Entries, m: int, step: object) -> list[RemovableHandle]:
    """Hooks on the nodes of ``entries`` that divide the gradients of those edges by
    ``m``; a node that ``step`` (a token of the step's) hooked already is left as it is
    (one that several microbatches' graphs share: ``x.tanh()`` taken before the step)."""
    handles = []
    for node, at in entries.items():
        if node.metadata.get(_HOOKED) is step:
            continue
        node.metadata[_HOOKED] = step
        wanted = frozenset(at)

        def divided(grads: Any, _: Any, wanted: frozenset[int] = wanted) -> Any:
            return tuple(g / m if i in wanted and g is not None else g for i, g in enumerate(grads))

        handles.append(node.register_hook(divided))
    return handles
