"""The tensors a pipeline's loss differentiates besides its last stage's parameters.

A ``loss_fn`` that is a module lists its parameters; one that is a plain function may read
parameters too: a lambda closing over a learnt temperature, a ``functools.partial`` or a
bound method of a module that holds some, a weight of a stage tied into the loss. The
runtime must treat those as a loss module's (divided by m once with the last stage's, see
``pipeline_scale``; differentiated by the last stage's W under zero bubble; averaged over
``dp_group``), else under B they got m times the unpipelined model's gradient where m is
not a power of two, and under I and W none.

No Python object names them, so they are found in the loss's autograd graph: each forward
of the last stage walks the graph the loss function itself added, from the loss down to
where it reaches its arguments (the stage's output, the target, ``loss_kwargs``: the
walk stops at their nodes, taken before the call, so an in-place change of the output
does not hide what lies above it), and keeps the leaves that require grad there
(``AccumulateGrad`` nodes' ``variable``), the last stage's own parameters set apart. That
is a few nodes per microbatch (an MSE of a scaled output: three), not the stage's graph:
3 to 5 microseconds with the look at its arguments (MSE, a closure's MSE, a cross
entropy), against a forward's milliseconds. The set is this step's (found anew each step:
``loss_fn`` may change between steps), and grows as the step's microbatches reach more (a
loss whose graph depends on its data: ``StepScaling.more``).

What the walk stops at is the step's own data, not a parameter: a target or a
``loss_kwargs`` tensor that requires grad is left as before (whole-batch tensors of the
step, not the model's), and so is a tensor the last stage's forward reads without
holding it (that is the stage's graph, below its output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.autograd_graph import leaf_variables
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["LossLeaves", "Stops", "module_params"]

#: where a walk of the loss's graph ends: the ids of its arguments' tensors that require
#: grad, and their graph nodes
Stops = tuple[set[int], set[Any]]


class LossLeaves:
    """One step's tensors of a loss's own (:meth:`see` at each forward of the last stage)."""

    def __init__(self) -> None:
        self.found: dict[int, torch.Tensor] = {}  # id -> tensor, in the order found
        self._apart: set[int] = set()  # ids of the last stage's parameters the loss read

    @staticmethod
    def stops(*arguments: Any) -> Stops:
        """Where a walk from the loss ends (``arguments``: pytrees of what the loss and the
        stage were given and gave), taken before the loss is computed."""
        tensors = []
        for tree in arguments:  # (a tensor or nothing mostly: no pytree walk for those)
            if isinstance(tree, torch.Tensor):
                if tree.requires_grad:
                    tensors.append(tree)
            elif tree is not None:
                tensors += [t for t in tensor_leaves(tree) if t.requires_grad]
        return {id(t) for t in tensors}, {t.grad_fn for t in tensors if t.grad_fn is not None}

    def see(
        self, loss: torch.Tensor, stops: Stops, own: Callable[[], Iterable[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """The leaves ``loss`` reaches before ``stops`` that the step had not found yet and
        that are not among ``own()`` (the last stage's parameters, listed only when a new
        leaf turns up), now kept in :attr:`found`."""
        ids, nodes = stops
        new = [
            var
            for var in leaf_variables([loss.grad_fn], nodes)
            if id(var) not in ids and id(var) not in self.found and id(var) not in self._apart
        ]
        if not new:
            return []
        mine = {id(p) for p in own()}
        kept = []
        for var in new:
            if id(var) in mine:
                self._apart.add(id(var))
            elif id(var) not in self.found:  # (a leaf reached twice is one)
                self.found[id(var)] = var
                kept.append(var)
        return kept

    def weights(self, loss_fn: Any) -> list[torch.Tensor]:
        """The loss's parameters: a module's (all of them, reached by this step or not),
        then those found, each once."""
        params = {id(p): p for p in module_params(loss_fn)}
        for key, var in self.found.items():
            params.setdefault(key, var)
        return list(params.values())


def module_params(loss_fn: Any) -> list[torch.Tensor]:
    """A module ``loss_fn``'s parameters that require grad (none for a function)."""
    if not isinstance(loss_fn, nn.Module):
        return []
    return [p for p in loss_fn.parameters() if p.requires_grad]
