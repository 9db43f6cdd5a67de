"""Dependency computation: literal dependency tables, then properties against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from graphs_for_tests import dist_graph, local_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from xgrad import dependencies as deps_mod
from xgrad.dependencies import (
    compute_dependencies,
    reachable_from,
    reaching,
    unused_parameters,
)
from xgrad.graph import BackwardGraph, NodeKind
from xgrad.graph_builder import GraphBuilder


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
def test_reaching_is_every_node_a_target_is_reached_from(case: tuple) -> None:
    g, roots, sends, _ = case
    targets = sorted(set(roots + sends))
    got = reaching(g, targets).tolist()
    assert got == [bool(_brute_reach(g, [u]) & set(targets)) for u in range(g.num_nodes)]


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_python_walk_matches_scipy_walk(case: tuple) -> None:
    g, roots, sends, _ = case
    seeds = np.unique(np.asarray(roots + sends, dtype=np.int64))
    if seeds.size == 0:
        return
    py = deps_mod._reach_python(g.indptr, g.dst, g.num_nodes, seeds)
    sp = deps_mod._reach_scipy(g.indptr, g.dst, g.num_nodes, seeds)
    assert py.tolist() == sp.tolist() == reachable_from(g, seeds.tolist()).tolist()


@settings(max_examples=80, deadline=None)
@given(random_graphs())
def test_list_walk_matches_array_walk(case: tuple) -> None:
    """Small graphs take the Python-list path; it must give the array path's result."""
    g, roots, sends, outputs = case
    seeds = tuple(roots) + tuple(sends)
    for out in (None, tuple(outputs)):
        small = deps_mod._dependencies_lists(g, seeds, out)
        big = deps_mod._dependencies_arrays(g, seeds, out)
        for a, b in zip(small, big, strict=True):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
