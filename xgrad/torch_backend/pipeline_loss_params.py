"""The tensors a pipeline stage differentiates besides its parameters: those its loss, or
its forward, reads without holding them.

A ``loss_fn`` that is a module lists its parameters; one that is a plain function may read
parameters too: a lambda closing over a learnt temperature, a ``functools.partial`` or a
bound method of a module that holds some, a weight of a stage tied into the loss. A
stage's forward may read tensors it does not hold as well: a module-level
``nn.Parameter``, a gain kept in a plain list, another partition's weight (an embedding
tied into the head). The runtime must treat those as the stage's parameters (divided by m
once with them, see ``pipeline_scale``; differentiated by the stage's W under zero
bubble; averaged over ``dp_group``), else under B they got m times the unpipelined
model's gradient where m is not a power of two, and under I and W none.

No Python object names them, so they are found in the autograd graph: each forward walks
the graph from the loss (the last stage) or the stage's outputs down to where it reaches
the stage's arguments (its input, its keywords; the target and ``loss_kwargs``: the
walk stops at their nodes, taken before the call), and keeps the leaves that require grad
there (``AccumulateGrad`` nodes' ``variable``), the stage's own parameters set apart.
What the walk stops at is the step's own data, not the model's: the runtime divides what
reaches it as it reaches it (``StepScaling.begin``), and W differentiates it by a whole
backward (``StageSettings._takes_batch_grad``). So is what the step was given whole, or
computed it from (the batch ``x`` a loss closes over): the walk does not go into that
graph either, and what it reads there is data, never found (``pipeline_step_data``).

Where nothing needs them found (m a power of two, so each loss is divided before its
backward; no W; no ``dp_group``: every backward reaches them, each loss divided), the walk
stops at the stage's output: the loss's few nodes (an MSE of a scaled output: three), 3
to 5 microseconds a microbatch, and none for the other stages. Else it walks the stage's
graph: about 0.2 microseconds a node (40 for four transformer layers, 2% of their forward
on a CPU). The set is this step's (found anew each step: ``loss_fn`` and the model may
change between steps), and grows as the step's microbatches reach more (a graph that
depends on its data: ``StepScaling.more``). The same walks note the nodes made before the
forward that they meet (``w.tanh()`` taken before the step: ``pipeline_shared_graph``),
and where the stage's graph is not walked whole it is walked for those once a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.pipeline_shared_graph import Made, reaches_older, walk
from xgrad.torch_backend.pipeline_step_data import Entries, StepData
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["StageLeaves", "Stops", "module_params"]

#: where a walk of a stage's graph ends: the ids of its arguments' tensors that require
#: grad, and their graph nodes
Stops = tuple[set[int], set[Any]]


class StageLeaves:
    """One step's tensors of a stage's own, besides its parameters (:meth:`see` at each of
    its forwards): its loss's too on the last stage."""

    def __init__(self) -> None:
        self.found: dict[int, torch.Tensor] = {}  # id -> tensor, in the order found
        self._apart: set[int] = set()  # ids of the stage's parameters the walk reached
        #: a walk met a node made before its forward, that the microbatches' graphs share
        #: (its backwards keep the graph: pipeline_shared_graph)
        self.older = False
        self.probed = False  # the stage's graph walked for such nodes alone (:meth:`probe`)

    @staticmethod
    def stops(*arguments: Any) -> Stops:
        """Where a walk ends (``arguments``: pytrees of what the stage and its loss were
        given, and of what the stage gave where the walk starts at the loss), taken
        before the call."""
        tensors = []
        for tree in arguments:  # (a tensor or nothing mostly: no pytree walk for those)
            if isinstance(tree, torch.Tensor):
                if tree.requires_grad:
                    tensors.append(tree)
            elif tree is not None:
                tensors += [t for t in tensor_leaves(tree) if t.requires_grad]
        return {id(t) for t in tensors}, {t.grad_fn for t in tensors if t.grad_fn is not None}

    def see(
        self,
        roots: Iterable[torch.Tensor],
        stops: Stops,
        own: Callable[[], Iterable[torch.Tensor]],
        data: StepData | None = None,
        made: Made = (0, 1 << 64),
    ) -> tuple[list[torch.Tensor], Entries]:
        """The leaves ``roots`` (the loss, or the stage's outputs) reach before ``stops``
        that the step had not found yet and that are not among ``own()`` (the stage's
        parameters, listed only when a new leaf turns up), now kept in :attr:`found`; and
        where they read the step's ``data`` (``pipeline_step_data``: never found). A node
        numbered outside ``made``, the numbers the forward's own nodes took (made before
        it: ``pipeline_shared_graph``), sets :attr:`older`."""
        ids, nodes = stops
        fns, reached = [], []
        for t in roots:
            if t.grad_fn is not None:
                fns.append(t.grad_fn)
            elif t.requires_grad:  # an output that is a leaf itself
                reached.append(t)
        more, entries, older = walk(fns, nodes, made, data)
        reached += more
        self.older = self.older or older
        new = [
            var
            for var in reached
            if id(var) not in ids and id(var) not in self.found and id(var) not in self._apart
        ]
        if not new:
            return [], entries
        mine = {id(p) for p in own()}
        kept = []
        for var in new:
            if id(var) in mine:
                self._apart.add(id(var))
            elif id(var) not in self.found:  # (a leaf reached twice is one)
                self.found[id(var)] = var
                kept.append(var)
        return kept, entries

    def probe(self, roots: Iterable[torch.Tensor], stops: Stops, made: Made) -> None:
        """Whether ``roots`` (a stage's outputs) reach, before ``stops``, a node numbered
        outside ``made`` (made before the forward): :attr:`older` where they do (the stage's graph walked once a step,
        where its forwards are not walked whole)."""
        self.probed = True
        fns = [t.grad_fn for t in roots if t.grad_fn is not None]
        self.older = self.older or reaches_older(fns, stops[1], made)

    def weights(self, loss_fn: Any = None) -> list[torch.Tensor]:
        """The tensors found, after a module ``loss_fn``'s parameters (all of them, reached
        by this step or not: the last stage's), each once."""
        params = {id(p): p for p in module_params(loss_fn)}
        for key, var in self.found.items():
            params.setdefault(key, var)
        return list(params.values())


def module_params(loss_fn: Any) -> list[torch.Tensor]:
    """A module ``loss_fn``'s parameters that require grad (none for a function)."""
    if not isinstance(loss_fn, nn.Module):
        return []
    return [p for p in loss_fn.parameters() if p.requires_grad]
