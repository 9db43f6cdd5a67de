"""A backward graph as frozen data (the dependency computation is :mod:`xgrad.dependencies`).

A backward graph has one node per backward function and one edge per gradient that flows
from a node to the next one, exactly like the ``next_edges`` of PyTorch's autograd nodes:
edge ``k`` leaving node ``u`` carries ``u``'s ``k``-th output gradient into input number
``input_nr`` of its destination. Nodes are of four kinds (:class:`NodeKind`): ordinary
functions, gradient accumulators of parameters (leaves, with the parameter's index), and
the ``send`` / ``recv`` nodes that RPC leaves in a distributed autograd context.

Edges are stored in compressed sparse rows (numpy arrays), so a million-node graph costs a
few arrays and is walked in linear time. Two ways to make one: node by node with
:class:`~xgrad.graph_builder.GraphBuilder`,

>>> from xgrad.graph_builder import GraphBuilder
>>> b = GraphBuilder()
>>> loss = b.add_node("function", "MseBackward")
>>> mm = b.add_node("function", "MmBackward")
>>> w = b.add_node("accumulate", "w", param=0)
>>> b.add_edge(loss, mm)
>>> b.add_edge(mm, w)
>>> g = b.build()
>>> from xgrad.dependencies import compute_dependencies
>>> compute_dependencies(g, roots=[loss]).table()
{0: 0, 1: 1, 2: 1}

or, for big graphs made by a program (a jaxpr walk, a benchmark), directly from arrays with
:meth:`BackwardGraph.from_arrays`, whose checks and row layout live, with
:class:`NodeKind`, in :mod:`xgrad.graph_arrays`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from xgrad.graph_arrays import NodeKind as NodeKind
from xgrad.graph_arrays import graph_from_arrays

if TYPE_CHECKING:
    from xgrad.dependencies import Dependencies as Dependencies
    from xgrad.dependencies import compute_dependencies as compute_dependencies
    from xgrad.dependencies import reachable_from as reachable_from
    from xgrad.dependencies import unused_parameters as unused_parameters
    from xgrad.graph_builder import GraphBuilder as GraphBuilder

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, eq=False)
class BackwardGraph:
    """A backward graph: node arrays plus edges in compressed sparse rows (by source node).

    Attributes:
        kinds: ``(n,)`` int8, a :class:`NodeKind` per node.
        params: ``(n,)`` int64, the parameter index of an accumulator, -1 for other nodes.
        names: ``n`` labels, for messages and printing only (may repeat, may be empty).
        indptr: ``(n + 1,)`` int64; node ``u``'s edges are ``indptr[u]:indptr[u + 1]``, in
            output order (edge ``k`` of ``u`` carries ``u``'s ``k``-th output gradient).
        dst: ``(E,)`` int64, the destination node of each edge.
        input_nr: ``(E,)`` int64, which input of the destination the edge feeds.

    All arrays are read-only; build one with :class:`GraphBuilder` or :meth:`from_arrays`.
    """

    kinds: Any
    params: Any
    names: tuple[str, ...]
    indptr: Any
    dst: Any
    input_nr: Any
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_arrays(
        cls,
        kinds: npt.ArrayLike,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        *,
        input_nr: npt.ArrayLike | None = None,
        params: npt.ArrayLike | None = None,
        names: Sequence[str] | None = None,
    ) -> BackwardGraph:
        """Build a graph from flat arrays (vectorised; the way to make big graphs).

        Args:
            kinds: one :class:`NodeKind` value per node.
            src, dst: one entry per edge. Edges keep their given order within a source node
                (a stable sort), which is the order of that node's outputs.
            input_nr: input number per edge (default 0 everywhere).
            params: parameter index per node, -1 for non-accumulators (default: accumulators
                numbered 0, 1, ... in node order).
            names: a label per node (default none: :meth:`name` then shows the kind).

        Raises:
            ValueError: on out-of-range node ids, unknown kinds, an accumulator without a
                parameter index (or a parameter with two accumulators), or an accumulator or
                ``recv`` node with outgoing edges (both are leaves).
        """
        return graph_from_arrays(
            cls, kinds, src, dst, input_nr=input_nr, params=params, names=names
        )

    @property
    def num_nodes(self) -> int:
        return int(self.kinds.size)

    @property
    def num_edges(self) -> int:
        return int(self.dst.size)

    @property
    def src(self) -> IntArray:
        """``(E,)`` source node of every edge (aligned with :attr:`dst`)."""
        if "src" not in self._cache:
            s = np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))
            s.setflags(write=False)
            self._cache["src"] = s
        return self._cache["src"]  # type: ignore[no-any-return]

    def name(self, node: int) -> str:
        """The node's label, or its kind (and parameter) when it has none."""
        if self.names and self.names[node]:
            return self.names[node]
        kind = NodeKind(int(self.kinds[node]))
        if kind is NodeKind.ACCUMULATE:
            return f"accumulate[{int(self.params[node])}]"
        return f"{kind.name.lower()}#{node}"

    def kind(self, node: int) -> NodeKind:
        return NodeKind(int(self.kinds[node]))

    def next_edges(self, node: int) -> list[tuple[int, int]]:
        """``[(dst, input_nr), ...]`` leaving ``node``, in output order."""
        lo, hi = int(self.indptr[node]), int(self.indptr[node + 1])
        return list(zip(self.dst[lo:hi].tolist(), self.input_nr[lo:hi].tolist(), strict=True))

    def num_inputs(self) -> IntArray:
        """``(n,)`` number of inputs per node: one more than the largest incoming input_nr."""
        if "num_inputs" not in self._cache:
            out = np.zeros(self.num_nodes, dtype=np.int64)
            np.maximum.at(out, self.dst, self.input_nr + 1)
            out.setflags(write=False)
            self._cache["num_inputs"] = out
        return self._cache["num_inputs"]  # type: ignore[no-any-return]

    def accumulator(self, param: int) -> int:
        """The node id of parameter ``param``'s accumulator (ValueError if it has none)."""
        hit = np.flatnonzero(self.params == param)
        if hit.size == 0:
            raise ValueError(f"param={param} has no accumulator node in this graph")
        return int(hit[0])

    def nodes_of_kind(self, kind: NodeKind | str) -> IntArray:
        return np.flatnonzero(self.kinds == NodeKind.parse(kind)).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (small graphs: printing, saving, comparing)."""
        return {
            "nodes": [
                {"kind": self.kind(u).name.lower(), "name": self.names[u] if self.names else ""}
                | ({"param": int(self.params[u])} if self.params[u] >= 0 else {})
                for u in range(self.num_nodes)
            ],
            "edges": [
                [int(s), int(d), int(k)]
                for s, d, k in zip(
                    self.src.tolist(), self.dst.tolist(), self.input_nr.tolist(), strict=True
                )
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackwardGraph:
        """The inverse of :meth:`to_dict` (validated like :meth:`from_arrays`)."""
        try:
            nodes, edges = data["nodes"], data["edges"]
            kinds = [int(NodeKind.parse(nd["kind"])) for nd in nodes]
            params = [int(nd.get("param", -1)) for nd in nodes]
            names = [str(nd.get("name", "")) for nd in nodes]
            src, dst, nr = ([int(e[i]) for e in edges] for i in range(3))
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(
                f"not a BackwardGraph description ({err!r}): {str(data)[:80]}"
            ) from None
        return cls.from_arrays(kinds, src, dst, input_nr=nr, params=params, names=names)

    @classmethod
    def from_json(cls, text: str) -> BackwardGraph:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BackwardGraph):
            return NotImplemented
        return self.names == other.names and all(
            np.array_equal(getattr(self, a), getattr(other, a))
            for a in ("kinds", "params", "indptr", "dst", "input_nr")
        )

    __hash__ = None  # type: ignore[assignment]


#: names defined in the modules next to this one, still importable from here.
_MOVED = {
    "GraphBuilder": "xgrad.graph_builder",
    "Dependencies": "xgrad.dependencies",
    "compute_dependencies": "xgrad.dependencies",
    "reachable_from": "xgrad.dependencies",
    "unused_parameters": "xgrad.dependencies",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'xgrad.graph' has no attribute {name!r}")
