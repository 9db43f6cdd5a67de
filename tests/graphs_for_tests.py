"""Two small backward graphs that the graph, builder and dependency tests share."""

from __future__ import annotations

from xgrad.graph import BackwardGraph
from xgrad.graph_builder import GraphBuilder


def local_graph() -> BackwardGraph:
    """loss -> mul -> {add, w}; add -> {b, w}; an accumulator for an unused parameter.

    ::

        0 loss ─► 1 mul ─► 2 add ─► 4 acc b (param 1)
                    │         └───► 3 acc w (param 0)
                    └─────────────► 3 acc w
        5 acc u (param 2), reached by nothing
    """
    b = GraphBuilder()
    loss = b.add_node("function", "loss")
    mul = b.add_node("function", "mul")
    add = b.add_node("function", "add")
    w = b.add_node("accumulate", "w", param=0)
    bias = b.add_node("accumulate", "b", param=1)
    b.add_node("accumulate", "u", param=2)
    b.add_edge(loss, mul)
    b.add_edge(mul, add)
    b.add_edge(mul, w)
    b.add_edge(add, bias)
    b.add_edge(add, w, input_nr=0)
    return b.build()


def dist_graph() -> BackwardGraph:
    """A worker's graph in a distributed context.

    ::

        0 root ─► 1 recv          (gradient goes back to the worker we received from)
           └────► 3 f ─► 4 acc p0
        2 send ─────┘             (a gradient arrives here from another worker)
        6 g ─► 5 acc p1           (reached by neither)
    """
    b = GraphBuilder()
    root = b.add_node("function", "root")
    recv = b.add_node("recv", "recv")
    send = b.add_node("send", "send")
    f = b.add_node("function", "f")
    a0 = b.add_node("accumulate", "p0", param=0)
    a1 = b.add_node("accumulate", "p1", param=1)
    g = b.add_node("function", "g")
    b.add_edge(root, recv)
    b.add_edge(root, f)
    b.add_edge(send, f)
    b.add_edge(f, a0)
    b.add_edge(g, a1)
    return b.build()
