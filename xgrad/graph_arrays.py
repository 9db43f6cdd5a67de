"""The flat arrays a backward graph is made of: node kinds, and edges checked into rows.

:class:`NodeKind` is what each entry of a graph's ``kinds`` array means;
:func:`graph_from_arrays` checks flat per-node and per-edge arrays (ids in range, known
kinds, one accumulator per parameter, accumulators and recvs as leaves) and lays the edges
out in compressed sparse rows by source node, read-only. Kept apart from
:mod:`xgrad.graph` (the graph's queries and its JSON form, which re-exports
:class:`NodeKind` and whose :meth:`~xgrad.graph.BackwardGraph.from_arrays` calls this)
because checking and laying out the arrays is a job of its own, and the longest.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from xgrad.graph import BackwardGraph

__all__ = ["NodeKind", "graph_from_arrays"]


class NodeKind(enum.IntEnum):
    """What a node does in the backward pass."""

    FUNCTION = 0  # an ordinary backward function: gradients in, gradients out
    ACCUMULATE = 1  # a parameter's gradient accumulator (a leaf; has a parameter index)
    SEND = 2  # where a tensor was sent to another worker: its gradient comes back here
    RECV = 3  # where a tensor was received: its gradient is sent back to the sender (a leaf)

    @classmethod
    def parse(cls, kind: NodeKind | str | int) -> NodeKind:
        """Accept a :class:`NodeKind`, its lower-case name (``"accumulate"``) or its value."""
        if isinstance(kind, str):
            try:
                return cls[kind.upper()]
            except KeyError:
                raise ValueError(
                    f"kind={kind!r} is not a node kind; expected one of "
                    f"{[k.name.lower() for k in cls]}"
                ) from None
        try:
            return cls(int(kind))
        except ValueError:
            raise ValueError(f"kind={kind!r} is not a node kind (0..{len(cls) - 1})") from None


def _frozen(a: npt.ArrayLike, dtype: type) -> Any:
    out: Any = np.array(a, dtype=dtype, copy=True).reshape(-1)
    out.setflags(write=False)
    return out


def graph_from_arrays(
    cls: type[BackwardGraph],
    kinds: npt.ArrayLike,
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    *,
    input_nr: npt.ArrayLike | None = None,
    params: npt.ArrayLike | None = None,
    names: Sequence[str] | None = None,
) -> BackwardGraph:
    """The work of :meth:`~xgrad.graph.BackwardGraph.from_arrays`, building a ``cls``."""
    kind_arr = np.asarray(kinds, dtype=np.int64).reshape(-1)
    n = int(kind_arr.size)
    bad_kind = np.flatnonzero((kind_arr < 0) | (kind_arr >= len(NodeKind)))
    if bad_kind.size:
        u = int(bad_kind[0])
        raise ValueError(f"kinds[{u}]={int(kind_arr[u])} is not a NodeKind value")
    src_arr = np.asarray(src, dtype=np.int64).reshape(-1)
    dst_arr = np.asarray(dst, dtype=np.int64).reshape(-1)
    if src_arr.shape != dst_arr.shape:
        raise ValueError(f"src has {src_arr.size} edges but dst has {dst_arr.size}")
    nr_arr = (
        np.zeros_like(src_arr)
        if input_nr is None
        else np.asarray(input_nr, dtype=np.int64).reshape(-1)
    )
    if nr_arr.shape != src_arr.shape:
        raise ValueError(f"input_nr has {nr_arr.size} entries, expected {src_arr.size}")
    for label, arr in (("src", src_arr), ("dst", dst_arr)):
        bad = np.flatnonzero((arr < 0) | (arr >= n))
        if bad.size:
            e = int(bad[0])
            raise ValueError(f"{label}[{e}]={int(arr[e])} is not a node id (0..{n - 1})")
    bad = np.flatnonzero(nr_arr < 0)
    if bad.size:
        raise ValueError(f"input_nr[{int(bad[0])}]={int(nr_arr[bad[0]])} must be >= 0")
    is_acc = kind_arr == NodeKind.ACCUMULATE
    if params is None:
        param_arr = np.full(n, -1, dtype=np.int64)
        param_arr[is_acc] = np.arange(int(is_acc.sum()), dtype=np.int64)
    else:
        param_arr = np.asarray(params, dtype=np.int64).reshape(-1)
        if param_arr.size != n:
            raise ValueError(f"params has {param_arr.size} entries, expected {n} (one a node)")
    wrong = np.flatnonzero(is_acc != (param_arr >= 0))
    if wrong.size:
        u = int(wrong[0])
        raise ValueError(
            f"node {u} (kind {NodeKind(kind_arr[u]).name.lower()}) has param="
            f"{int(param_arr[u])}: accumulators need a parameter index >= 0, other nodes -1"
        )
    acc_params = np.sort(param_arr[is_acc])
    dup = np.flatnonzero(acc_params[1:] == acc_params[:-1])
    if dup.size:
        raise ValueError(f"parameter {int(acc_params[dup[0]])} has two accumulator nodes")
    counts = np.bincount(src_arr, minlength=n)
    leafy = np.flatnonzero(
        (counts > 0) & ((kind_arr == NodeKind.ACCUMULATE) | (kind_arr == NodeKind.RECV))
    )
    if leafy.size:
        u = int(leafy[0])
        raise ValueError(
            f"node {u} is a {NodeKind(kind_arr[u]).name.lower()} node with "
            f"{int(counts[u])} outgoing edges; accumulators and recvs are leaves"
        )
    order = np.argsort(src_arr, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    if names is None:
        name_tuple: tuple[str, ...] = ()
    else:
        name_tuple = tuple(str(s) for s in names)
        if len(name_tuple) != n:
            raise ValueError(f"names has {len(name_tuple)} entries, expected {n}")
        if not any(name_tuple):
            name_tuple = ()  # all empty is the same as none
    graph = cls(
        kinds=_frozen(kind_arr, np.int8),
        params=_frozen(param_arr, np.int64),
        names=name_tuple,
        indptr=_frozen(indptr, np.int64),
        dst=_frozen(dst_arr[order], np.int64),
        input_nr=_frozen(nr_arr[order], np.int64),
    )
    src_sorted = src_arr[order]
    src_sorted.setflags(write=False)
    graph._cache["src"] = src_sorted
    return graph
