"""Backward graphs as data: literal dependency tables, then properties against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xgrad import graph as graph_mod
from xgrad.graph import (
    BackwardGraph,
    GraphBuilder,
    NodeKind,
    compute_dependencies,
    reachable_from,
    unused_parameters,
)


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


def test_local_dependency_table() -> None:
    deps = compute_dependencies(local_graph(), roots=[0])
    assert deps.table() == {0: 0, 1: 1, 2: 1, 3: 2, 4: 1}
    assert deps.leaves.tolist() == [3, 4]
    assert deps.needed_nodes() == [0, 1, 2, 3, 4]


def test_local_needed_for_wanted_outputs() -> None:
    g = local_graph()
    assert compute_dependencies(g, [0], outputs=[4]).needed_nodes() == [0, 1, 2, 4]
    assert compute_dependencies(g, [0], outputs=[3]).needed_nodes() == [0, 1, 2, 3]
    # Starting lower in the graph: only what lies below counts.
    deps = compute_dependencies(g, [2])
    assert deps.table() == {2: 0, 3: 1, 4: 1}


def test_dist_dependency_table_counts_edges_from_sends() -> None:
    g = dist_graph()
    deps = compute_dependencies(g, roots=[0], sends=[2])
    assert deps.table() == {0: 0, 1: 1, 2: 0, 3: 2, 4: 1}
    assert deps.leaves.tolist() == [1, 4]
    assert deps.needed_nodes() == [0, 1, 2, 3, 4]
    # Without the send, f waits for one gradient only.
    assert compute_dependencies(g, roots=[0]).table() == {0: 0, 1: 1, 3: 1, 4: 1}
    # A worker that only receives: the walk starts at its send node.
    assert compute_dependencies(g, roots=[], sends=[2]).table() == {2: 0, 3: 1, 4: 1}


def test_recv_nodes_are_always_needed() -> None:
    deps = compute_dependencies(dist_graph(), roots=[0], sends=[2], outputs=[])
    assert deps.needed_nodes() == [0, 1]


def test_unused_parameters() -> None:
    assert unused_parameters(local_graph(), [0]) == (2,)
    assert unused_parameters(local_graph(), [2]) == (2,)
    assert unused_parameters(local_graph(), [2], num_params=5) == (2, 3, 4)
    assert unused_parameters(dist_graph(), [0]) == (1,)
    assert unused_parameters(dist_graph(), [], sends=[2]) == (1,)
    with pytest.raises(ValueError, match="num_params=2"):
        unused_parameters(local_graph(), [0], num_params=2)


def test_bad_walks_are_refused() -> None:
    g = dist_graph()
    with pytest.raises(ValueError, match=r"sends contains node 3 \('f'\)"):
        compute_dependencies(g, [0], sends=[3])
    with pytest.raises(ValueError, match="roots contains 9"):
        compute_dependencies(g, [9])
    b = GraphBuilder()
    b.add_edge(b.add_node("function", "top"), b.add_node("function", "dead_end"))
    with pytest.raises(ValueError, match=r"node 1 \('dead_end', kind function\)"):
        compute_dependencies(b.build(), [0])


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


# ---------------------------------------------------------------- properties vs brute force


@st.composite
def random_graphs(draw: st.DrawFn) -> tuple[BackwardGraph, list[int], list[int], list[int]]:
    n = draw(st.integers(2, 24))
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, n - 2), st.integers(1, n - 1)).filter(lambda p: p[0] < p[1]),
            max_size=3 * n,
        )
    )
    has_out = {s for s, _ in pairs}
    kinds = []
    for u in range(n):
        if u in has_out:
            kinds.append(draw(st.sampled_from([NodeKind.FUNCTION, NodeKind.SEND])))
        else:
            kinds.append(draw(st.sampled_from([NodeKind.ACCUMULATE, NodeKind.RECV])))
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    nr = [draw(st.integers(0, 2)) for _ in pairs]
    g = BackwardGraph.from_arrays(kinds, src, dst, input_nr=nr)
    roots = draw(st.lists(st.integers(0, n - 1), max_size=3))
    send_nodes = [u for u in range(n) if kinds[u] == NodeKind.SEND]
    sends = draw(st.lists(st.sampled_from(send_nodes), max_size=3)) if send_nodes else []
    outputs = draw(st.lists(st.integers(0, n - 1), max_size=3))
    return g, roots, sends, outputs


def _brute_reach(g: BackwardGraph, seeds: list[int]) -> set[int]:
    seen = set(seeds)
    stack = list(seeds)
    while stack:
        u = stack.pop()
        for v, _ in g.next_edges(u):
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return seen


@settings(max_examples=150, deadline=None)
@given(random_graphs())
def test_dependencies_match_brute_force(case: tuple) -> None:
    g, roots, sends, outputs = case
    deps = compute_dependencies(g, roots, sends, outputs=outputs)
    reach = _brute_reach(g, roots + sends)
    assert set(np.flatnonzero(deps.reachable).tolist()) == reach
    for v in range(g.num_nodes):
        expected = sum(1 for u in reach for w, _ in g.next_edges(u) if w == v)
        assert deps.counts[v] == expected
    leaves = sorted(u for u in reach if not g.next_edges(u) and g.kind(u) != NodeKind.SEND)
    assert deps.leaves.tolist() == leaves
    targets = set(outputs) | {u for u in reach if g.kind(u) == NodeKind.RECV}
    needed = sorted(u for u in reach if _brute_reach(g, [u]) & targets)
    assert deps.needed_nodes() == needed
    # Default outputs: every leaf.
    all_out = compute_dependencies(g, roots, sends)
    assert all_out.needed_nodes() == sorted(u for u in reach if _brute_reach(g, [u]) & set(leaves))
    accs = {int(g.params[u]) for u in range(g.num_nodes) if g.kind(u) == NodeKind.ACCUMULATE}
    reached = {int(g.params[u]) for u in reach if g.kind(u) == NodeKind.ACCUMULATE}
    assert unused_parameters(g, roots, sends) == tuple(sorted(accs - reached))


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_python_walk_matches_scipy_walk(case: tuple) -> None:
    g, roots, sends, _ = case
    seeds = np.unique(np.asarray(roots + sends, dtype=np.int64))
    if seeds.size == 0:
        return
    py = graph_mod._reach_python(g.indptr, g.dst, g.num_nodes, seeds)
    sp = graph_mod._reach_scipy(g.indptr, g.dst, g.num_nodes, seeds)
    assert py.tolist() == sp.tolist() == reachable_from(g, seeds.tolist()).tolist()


def test_bench_runs_on_a_small_graph(capsys: pytest.CaptureFixture[str]) -> None:
    from xgrad import graph_bench
    from xgrad.cli import main

    assert main(["bench", "graph", "--nodes", "2000", "--edges", "5000", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "agree: True" in out
    g, roots, sends = graph_bench.random_graph(500, 1200, seed=3)
    assert graph_bench.plain_walk(g, roots, sends) == {
        k: v for k, v in compute_dependencies(g, roots, sends).table().items() if v
    }
