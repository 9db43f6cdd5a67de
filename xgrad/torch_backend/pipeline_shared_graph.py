"""Graphs made before a pipeline stage's forward that its microbatches share, and the walk
of a stage's graph that finds them (with the leaves it reads of its own).

A stage's forward or the loss may read a tensor computed once outside, before the step:
``w2 = w.tanh()`` of a parameter (module-level, or another module's), ``xt = x.tanh()`` of
a batch that requires grad, closed over by the loss. Every microbatch's graph then links
the same older nodes, and torch's backward frees the saved tensors of each node it runs:
the first microbatch's backward freed them, and the second raised "Trying to backward
through the graph a second time", where the unpipelined model runs one backward through
them (torch.distributed.pipelining fails the same way). Such a stage's backwards keep the
graph (``retain_graph=True``): its microbatch's own part goes all the same once the runtime
drops its output (the nodes, and their saved tensors, with their last reference), and the
older part is the user's, kept while they hold the tensor (``w2``), as any graph they hold.
(A ``saved_tensors_hooks`` pack that returns the very tensor it is given, an output with
its ``grad_fn``, makes a cycle that only a backward without ``retain_graph`` breaks: such a
stage's microbatch graphs then outlive the step.)

Autograd's sequence numbers tell which nodes are older: each node takes the next number of
its thread's counter when made, so the nodes a forward makes take the numbers from its
thread's counter at its start to that at its end (:func:`forward_mark`, read on either
side: :data:`Made`); a node numbered outside them was made before, in this thread or in
another (whose counter may be below or above this one's: ``w2`` made on the main thread,
the steps run in a worker thread, whose counter starts at 0, was taken for the forward's
own where only a number below the start told). ``AccumulateGrad`` nodes (and torch's
``Error`` nodes, that save nothing) are numbered the largest, never older; the nodes of
the stage's arguments, made before too, are where the walks stop. (One that another
thread numbered within the forward's numbers is not told apart; the nodes a forward makes
in other threads are taken as older: its backwards keep the graph, which goes with the
microbatch all the same.) Where the forwards are walked whole (``pipeline_loss_params``:
m not a power of two, a W pass, ``dp_group``) each forward tells; elsewhere the loss's few
nodes at each forward, and the stage's graph once a step, at its first forward with a graph
(:func:`reaches_older`, which stops at the first older node: 4 microseconds for the
bench's four 512-wide layers, whose forward takes about 1 ms on a CPU core). A stage that reads one on
later microbatches only is not seen there: its second backward through it raises the error
of :func:`explained`, which names the stage, the microbatch, the cause and the way out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr

from xgrad.torch_backend.pipeline_step_data import Entries, StepData

__all__ = ["Made", "explained", "forward_mark", "reaches_older", "walk"]

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]

#: torch's words when a backward runs a node whose saved tensors a backward freed
FREED = "Trying to backward through the graph a second time"

#: the number of the nodes that take none from a counter (``AccumulateGrad``, ``Error``)
_UNNUMBERED = (1 << 64) - 1

#: the numbers a forward's own nodes took: its thread's counter at its start and at its end
Made = tuple[int, int]


def forward_mark() -> int:
    """The number the next autograd node made in this thread takes (read before a forward
    and after it: the nodes it made took the numbers between, :data:`Made`)."""
    return int(_get_sequence_nr())


def _older(node: Any, made: Made) -> bool:
    """Whether ``node`` (not an ``AccumulateGrad``) was made before the forward that made
    the numbers ``made``: numbered outside them, whatever thread numbered it."""
    nr = node._sequence_nr()
    return not made[0] <= nr < made[1] and nr != _UNNUMBERED


def walk(
    roots: Iterable[Any], stop_nodes: set[Any], made: Made, data: StepData | None
) -> tuple[list[torch.Tensor], Entries, bool]:
    """From the ``grad_fn`` nodes ``roots``, never into ``stop_nodes`` (the stage's
    arguments' nodes) nor into ``data``'s graph (the step's data, ``pipeline_step_data``):
    the leaves met (in a depth-first walk's order), the edges into ``data``'s graph that no
    step tensor's hook divides, and whether a node made before the forward was met (numbered
    outside ``made``; the walk goes on into it: the leaves behind ``w.tanh()`` are read
    too)."""
    inside = data.nodes if data is not None else None
    covered = data.covered if data is not None else set()
    seen = set(stop_nodes)  # (one set to look in: the stops count as seen)
    todo: list[Any] = []
    for root in roots:
        if root is not None and root not in seen and (inside is None or root not in inside):
            seen.add(root)
            todo.append(root)
    leaves: list[torch.Tensor] = []
    entries: Entries = {}
    older = False
    while todo:
        node = todo.pop()
        if type(node) is _ACCUMULATE_GRAD:
            leaves.append(node.variable)
            continue
        if not older and _older(node, made):
            older = True
        if inside is None:  # (the loop below without the step's data: most walks)
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    todo.append(child)
            continue
        for i, (child, nr) in enumerate(node.next_functions):
            if child is None:
                continue
            if child in inside:
                if (child, nr) not in covered:
                    entries.setdefault(node, []).append(i)
            elif child not in seen:
                seen.add(child)
                todo.append(child)
    return leaves, entries, older


def reaches_older(roots: Iterable[Any], stop_nodes: set[Any], made: Made) -> bool:
    """Whether the ``grad_fn`` nodes ``roots`` reach, before ``stop_nodes``, a node made
    before the forward (numbered outside ``made``): the walk ends at the first."""
    seen = set(stop_nodes)
    todo = []
    for root in roots:
        if root is not None and root not in seen:
            seen.add(root)
            todo.append(root)
    while todo:
        node = todo.pop()
        if type(node) is _ACCUMULATE_GRAD:
            continue
        if _older(node, made):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return False


def explained(exc: BaseException, stage: int, microbatch: int) -> RuntimeError | None:
    """Torch's error for a graph a backward freed, in a pipeline stage's backward, as the
    step's cause and its way out; ``None`` for any other error."""
    if not isinstance(exc, RuntimeError) or FREED not in str(exc):
        return None
    return RuntimeError(
        f"{FREED}: stage {stage}'s backward of microbatch {microbatch} went through a "
        "graph that an earlier backward of this step freed: a tensor computed before the "
        "step (say w2 = w * 2, or x.tanh() of a batch that requires grad), or kept from an "
        "earlier microbatch's forward, that the stage's forward or the loss reads on every "
        "microbatch. The runtime keeps such a graph where it sees the stage read it: in "
        "the step's first forward of the stage, or in every forward where m is not a power "
        "of two, under zero bubble or dp_group; here it did not (a later microbatch read it "
        "first, an earlier one's forward made it, or another thread made it while the "
        "forward ran). Compute it inside the stage's forward (or the loss) on each call "
        "instead"
    )
