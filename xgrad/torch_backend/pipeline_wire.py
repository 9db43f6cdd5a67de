"""The pipeline's wire format: stage inputs and outputs as pytrees of tensors.

A stage may take and return any pytree torch's ``torch.utils._pytree`` flattens (tensors,
tuples, lists, dicts, named tuples) with tensors that need no gradient (integer masks,
constants) and plain Python constants (None, numbers, strings) among its leaves, and the
shapes may change from step to step. A forward message carries its tree's description
(JSON: the structure and per leaf its shape, dtype and whether it carries a gradient, or
its constant value) only when it differs from its edge's last for that microbatch (uneven
microbatches have shapes of their own), then each tensor leaf in flattening order; how
messages are framed and posted is :mod:`~xgrad.torch_backend.pipeline_comm`. A backward
message carries one gradient per leaf that carried a gradient forward, in the same order.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from xgrad.torch_backend.dist_wire import DTYPES
from xgrad.torch_backend.failure import abort_group
from xgrad.torch_backend.pipeline_rows import Rows, split_rows

__all__ = [
    "Description",
    "EdgeCache",
    "carried",
    "describe",
    "detach_tree",
    "differentiable",
    "layout",
    "retire",
    "spec_of",
    "spec_text",
    "split_batch",
    "tensor_leaves",
]

#: dtypes that may cross a stage boundary (the distributed backward's wire list), by name.
_DTYPES = {str(t): t for t in DTYPES}
_CONSTANT_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Description:
    """What a forward message holds: the tree and, per leaf, a tensor's layout or a constant.

    Attributes:
        spec: the tree structure (:func:`spec_text`).
        leaves: per leaf, ``("t", shape, dtype name, carries gradient)`` or ``("c", value)``.
    """

    spec: str
    leaves: tuple[tuple[Any, ...], ...]

    def to_bytes(self) -> bytes:
        return json.dumps({"spec": self.spec, "leaves": self.leaves}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Description:
        d = json.loads(data.decode())
        leaves = tuple(
            ("t", tuple(leaf[1]), leaf[2], bool(leaf[3])) if leaf[0] == "t" else ("c", leaf[1])
            for leaf in d["leaves"]
        )
        return cls(d["spec"], leaves)

    @property
    def gradient_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each leaf that carries a gradient, in order."""
        return [(leaf[1], _DTYPES[leaf[2]]) for leaf in self.leaves if leaf[0] == "t" and leaf[3]]


def _carries_gradient(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def carried(tree: Any, graph: bool = True, inputs: Any = None) -> list[bool]:
    """Per tensor leaf, whether it carries a gradient: a floating leaf that requires one.

    Without a graph (a data-parallel stage's checkpointed forward, run under ``no_grad``,
    whose recomputation will have one), any floating leaf but one of ``inputs`` passed
    through (which carries a gradient as the input did).
    """
    if graph:
        return [_carries_gradient(t) for t in tensor_leaves(tree)]
    passed = {id(t): _carries_gradient(t) for t in tensor_leaves(inputs)}
    return [
        (t.is_floating_point() or t.is_complex()) and passed.get(id(t), True)
        for t in tensor_leaves(tree)
    ]


def describe(
    tree: Any, where: str, carry: Sequence[bool] | None = None
) -> tuple[Description, list[torch.Tensor]]:
    """Flatten ``tree`` into its description and its tensor leaves; ``carry`` overrides
    which tensor leaves carry a gradient (default: those that require one).

    Raises:
        TypeError: a leaf is neither a tensor nor a constant (naming ``where`` and the leaf).
    """
    leaves, spec = pytree.tree_flatten(tree)
    described, tensors = _describe_leaves(leaves, where, carry)
    return Description(spec_text(spec), described), tensors


#: how :func:`spec_text` marks a structure that torch's JSON form cannot hold.
_PICKLED = "pickle:"


def spec_text(spec: pytree.TreeSpec) -> str:
    """A tree structure as text: torch's ``treespec_dumps`` JSON, or, for node types it
    cannot name (a named tuple or a ``register_pytree_node`` class without a
    ``serialized_type_name``), the pickled ``(type, context, children)`` nesting, whose
    classes go by reference as any pickle's do (the receiving rank imports them)."""
    try:
        return pytree.treespec_dumps(spec)
    except NotImplementedError:
        pass
    try:
        return _PICKLED + base64.b64encode(pickle.dumps(_nesting(spec))).decode()
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"a stage's output holds a class another rank could not import ({exc}); "
            "define a named tuple or pytree node class that crosses ranks at module level"
        ) from exc


def _nesting(spec: pytree.TreeSpec) -> Any:
    if spec.is_leaf():
        return None
    return (spec.type, spec.context, [_nesting(c) for c in spec.children()])


def _from_nesting(nesting: Any) -> pytree.TreeSpec:
    if nesting is None:
        return pytree.treespec_leaf()
    kind, context, children = nesting
    return pytree.TreeSpec(kind, context, [_from_nesting(c) for c in children])


def spec_of(text: str) -> pytree.TreeSpec:
    """The structure :func:`spec_text` wrote.

    Raises:
        TypeError: a class of the structure cannot be imported on this rank (naming it).
    """
    if not text.startswith(_PICKLED):
        return pytree.treespec_loads(text)
    try:
        nesting = pickle.loads(base64.b64decode(text[len(_PICKLED) :]))
    except (AttributeError, ImportError) as exc:
        raise TypeError(
            f"a stage's input holds a class this rank cannot import ({exc}); a named tuple "
            "or pytree node class crossing ranks must be importable on both"
        ) from exc
    return _from_nesting(nesting)


def _describe_leaves(
    leaves: list[Any], where: str, carry: Sequence[bool] | None
) -> tuple[tuple[tuple[Any, ...], ...], list[torch.Tensor]]:
    described: list[tuple[Any, ...]] = []
    tensors: list[torch.Tensor] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if str(leaf.dtype) not in _DTYPES:
                raise TypeError(f"{where}: leaf {i} has dtype {leaf.dtype}, which cannot be sent")
            flag = _carries_gradient(leaf) if carry is None else bool(carry[len(tensors)])
            described.append(("t", tuple(leaf.shape), str(leaf.dtype), flag))
            tensors.append(leaf)
        elif isinstance(leaf, _CONSTANT_TYPES):
            described.append(("c", leaf))
        else:
            raise TypeError(
                f"{where}: leaf {i} is a {type(leaf).__name__}; stage inputs and outputs are "
                "pytrees of tensors and constants (None, bool, int, float, str)"
            )
    return tuple(described), tensors


def rebuild(description: Description, tensors: Sequence[torch.Tensor]) -> Any:
    """The tree of ``description`` with ``tensors`` as its tensor leaves, in order."""
    it = iter(tensors)
    leaves = [next(it) if leaf[0] == "t" else leaf[1] for leaf in description.leaves]
    return pytree.tree_unflatten(leaves, spec_of(description.spec))


def detach_tree(tree: Any, carry: Sequence[bool]) -> Any:
    """Every tensor leaf detached; those that carry a gradient (``carry``, per tensor leaf)
    become leaves that require one (a stage's input, whose gradient goes back)."""
    flags = iter(carry)

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(next(flags))
        return leaf

    return pytree.tree_map(cut, tree)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``tree``."""
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def differentiable(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` that carry a gradient, in flattening order."""
    return [
        t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and _carries_gradient(t)
    ]


def split_batch(batch: Any, m: int, name: str, rank: int, rows: Rows | None = None) -> list[Any]:
    """A pytree batch as m microbatches: every tensor leaf split along dim 0 as torch's
    schedules split it (``tensor_split``: 10 rows into 4 are 3, 3, 2, 2), constants kept;
    each leaf's size noted in ``rows`` (:mod:`~xgrad.torch_backend.pipeline_rows`).

    Raises:
        TypeError: no tensor in ``batch``.
        ValueError: a leaf has fewer rows than m, or is a 0-dim tensor (naming ``name``
            and the leaf).
    """
    leaves, spec = pytree.tree_flatten(batch)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TypeError(
            f"rank {rank}: {name} must be a tensor or a pytree of tensors on this rank, "
            f"got {type(batch).__name__}"
        )
    columns: list[list[Any]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            label = name if len(leaves) == 1 else f"{name} leaf {i}"
            if leaf.dim() == 0:
                raise ValueError(
                    f"rank {rank}: {label} is a 0-dim tensor: it has no batch dimension to "
                    f"split into {m} microbatches (give it one, or pass a Python number, "
                    "which every microbatch gets as it is)"
                )
            what = f"{label} batch size {leaf.shape[0]}"
            columns.append(split_rows(leaf, m, 0, what, rank, rows))
        else:
            columns.append([leaf] * m)
    return [pytree.tree_unflatten([c[k] for c in columns], spec) for k in range(m)]


class EdgeCache:
    """Per edge (the wire's key: an edge and a microbatch), the description of the last
    message sent or received on it.

    Both ends update it with every message, so they agree on it after a step; the next
    step posts its receives for those layouts. Both ends must drop it together after a
    failed step (:meth:`clear`), since the other end may not have seen the last message.
    :meth:`describe` also keeps the tree structure it last flattened per edge, so an
    unchanged message is described without serialising its structure again.
    """

    def __init__(self) -> None:
        self._last: dict[Any, Description] = {}
        self._specs: dict[Any, tuple[Any, Description]] = {}

    def clear(self) -> None:
        self._last.clear()
        self._specs.clear()

    def last(self, edge: Any) -> Description | None:
        """The description last sent or received on ``edge``."""
        return self._last.get(edge)

    def remember(self, edge: Any, description: Description) -> None:
        """``description`` went over ``edge``."""
        self._last[edge] = description

    def describe(
        self, edge: Any, tree: Any, carry: Sequence[bool], where: str
    ) -> tuple[Description, list[torch.Tensor]]:
        """:func:`describe` of a message sent on ``edge``, reusing the last one's structure."""
        leaves, spec = pytree.tree_flatten(tree)
        described, tensors = _describe_leaves(leaves, where, carry)
        hit = self._specs.get(edge)
        if hit is not None and hit[1].leaves == described and hit[0] == spec:
            return hit[1], tensors
        description = Description(spec_text(spec), described)
        self._specs[edge] = (spec, description)
        return description, tensors


def layout(description: Description) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each tensor leaf of a message (the buffers it arrives in)."""
    return [
        (torch.Size(leaf[1]), _DTYPES[leaf[2]]) for leaf in description.leaves if leaf[0] == "t"
    ]


def empty_leaves(description: Description, device: Any) -> list[torch.Tensor]:
    """Buffers for the tensor leaves of a message."""
    return [
        torch.empty(leaf[1], dtype=_DTYPES[leaf[2]], device=device)
        for leaf in description.leaves
        if leaf[0] == "t"
    ]


def mark_gradients(description: Description, tensors: Sequence[torch.Tensor]) -> None:
    """Received leaves that carried a gradient on the sender require one here."""
    flags = [leaf[3] for leaf in description.leaves if leaf[0] == "t"]
    for t, flag in zip(tensors, flags, strict=True):
        t.requires_grad_(flag)


class _Retired:
    """Holds an aborted group's place among torch's group names: new groups are named by
    hashing their ranks with the number of named groups, so without it the next private
    group would take the aborted one's name, and its stale rendezvous keys in the store."""

    def shutdown(self) -> None:  # destroy_process_group shuts every named group down
        pass

    def abort(self) -> None:  # abort_group() (the default group's) aborts every named one
        pass


def retire(group: Any) -> None:
    """Abort a private group whose transfers a failed step left pending (they would make
    ``destroy_process_group`` wait for ever), keeping its name taken."""
    c10d = dist.distributed_c10d
    name = c10d._get_process_group_name(group)
    abort_group(group)
    c10d._world.pg_names[_Retired()] = name  # type: ignore[index, assignment]
