"""Building a graph node by node: bad nodes and edges are refused, naming them."""

from __future__ import annotations

import pytest

from xgrad.graph_builder import GraphBuilder


def test_builder_refuses_bad_nodes_and_edges() -> None:
    b = GraphBuilder()
    with pytest.raises(ValueError, match="accumulators need param"):
        b.add_node("accumulate", "w")
    with pytest.raises(ValueError, match="accumulators need param"):
        b.add_node("function", "f", param=0)
    with pytest.raises(ValueError, match="kind='leaf' is not a node kind"):
        b.add_node("leaf")
    a = b.add_node("accumulate", "w", param=0)
    f = b.add_node("function", "f")
    with pytest.raises(ValueError, match="dst=7 is not a node id"):
        b.add_edge(f, 7)
    b.add_edge(a, f)
    with pytest.raises(ValueError, match="node 0 is a accumulate node with 1 outgoing"):
        b.build()
    b2 = GraphBuilder()
    b2.add_node("accumulate", "w", param=0)
    b2.add_node("accumulate", "w again", param=0)
    with pytest.raises(ValueError, match="parameter 0 has two accumulator nodes"):
        b2.build()
