"""Building a :class:`~xgrad.graph.BackwardGraph` node by node (for small, hand-made graphs).

Big graphs made by a program (a jaxpr walk, a benchmark) go straight to
:meth:`BackwardGraph.from_arrays`; this builder collects nodes and edges in Python lists
and hands them over once.
"""

from __future__ import annotations

from xgrad.graph import BackwardGraph, NodeKind

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """Builds a :class:`BackwardGraph` one node and edge at a time.

    Node ids are handed out in order 0, 1, 2, ... The engine runs ready nodes with higher
    ids first (like autograd's sequence numbers), so add nodes in forward order: a later
    operation gets a higher id and its backward runs earlier.

    Edges leaving a node are numbered in the order they are added: the ``k``-th
    ``add_edge(u, ...)`` carries ``u``'s ``k``-th output gradient.
    """

    def __init__(self) -> None:
        self._kinds: list[int] = []
        self._params: list[int] = []
        self._names: list[str] = []
        self._src: list[int] = []
        self._dst: list[int] = []
        self._nr: list[int] = []

    def add_node(self, kind: NodeKind | str, name: str = "", param: int | None = None) -> int:
        """Add a node and return its id.

        Args:
            kind: ``"function"``, ``"accumulate"``, ``"send"``, ``"recv"`` or a NodeKind.
            name: a label for messages (e.g. ``"AddmmBackward0"`` or ``"layers.0.weight"``).
            param: the parameter index; required for accumulators, refused for the others.
        """
        k = NodeKind.parse(kind)
        if (k is NodeKind.ACCUMULATE) != (param is not None):
            raise ValueError(
                f"add_node(kind={k.name.lower()!r}, name={name!r}, param={param!r}): "
                "accumulators need param=<index>, other kinds take none"
            )
        if param is not None and (not isinstance(param, int) or param < 0):
            raise ValueError(f"param={param!r} must be an int >= 0 (node {name!r})")
        self._kinds.append(int(k))
        self._params.append(-1 if param is None else param)
        self._names.append(name)
        return len(self._kinds) - 1

    def add_edge(self, src: int, dst: int, input_nr: int = 0) -> None:
        """Gradient flows from ``src``'s next output into input ``input_nr`` of ``dst``."""
        n = len(self._kinds)
        for label, u in (("src", src), ("dst", dst)):
            if not 0 <= u < n:
                raise ValueError(f"add_edge: {label}={u} is not a node id (0..{n - 1})")
        if input_nr < 0:
            raise ValueError(f"add_edge({src}, {dst}): input_nr={input_nr} must be >= 0")
        self._src.append(src)
        self._dst.append(dst)
        self._nr.append(input_nr)

    @property
    def num_nodes(self) -> int:
        return len(self._kinds)

    def build(self) -> BackwardGraph:
        """Freeze into a :class:`BackwardGraph` (the builder stays usable)."""
        return BackwardGraph.from_arrays(
            self._kinds,
            self._src,
            self._dst,
            input_nr=self._nr,
            params=self._params,
            names=self._names,
        )
