"""Backward graphs as frozen data: arrays, names, JSON, equality."""

from __future__ import annotations

import pytest
from graphs_for_tests import local_graph

from xgrad.graph import BackwardGraph


def test_graph_is_frozen_data() -> None:
    g = local_graph()
    assert g == local_graph()
    with pytest.raises(ValueError):
        g.dst[0] = 1
    assert g.next_edges(1) == [(2, 0), (3, 0)]
    assert g.num_inputs().tolist() == [0, 1, 1, 1, 1, 0]
    assert g.accumulator(1) == 4
    assert g.to_dict()["edges"] == [[0, 1, 0], [1, 2, 0], [1, 3, 0], [2, 4, 0], [2, 3, 0]]
    assert g.to_dict()["nodes"][3] == {"kind": "accumulate", "name": "w", "param": 0}
    same = BackwardGraph.from_arrays(
        [0, 0, 0, 1, 1, 1],
        [2, 0, 1, 1, 2],
        [4, 1, 2, 3, 3],
        names=["loss", "mul", "add", "w", "b", "u"],
    )
    # Edges are regrouped by source but keep their order within a source: same graph.
    assert same == g
    assert BackwardGraph.from_json(g.to_json()) == g
    unnamed = BackwardGraph.from_arrays([0, 1], [0], [1])
    assert BackwardGraph.from_json(unnamed.to_json()) == unnamed
    assert unnamed.name(0) == "function#0" and unnamed.name(1) == "accumulate[0]"
    with pytest.raises(ValueError, match="not a BackwardGraph description"):
        BackwardGraph.from_dict({"nodes": []})
