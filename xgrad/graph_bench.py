"""``xgrad bench graph``: dependency computation on a million-node graph, against a plain walk.

PyTorch does this walk in C++ inside ``DistEngine::computeDependencies`` and does not
expose it, so the comparison is with the same algorithm written the way the C++ reads
(a queue, a seen set, a counter per edge) in Python; both results must agree.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np

from xgrad.dependencies import compute_dependencies, unused_parameters
from xgrad.graph import BackwardGraph, NodeKind
from xgrad.progress import progress
from xgrad.tables import Table, add_table_outputs, print_tables

HELP = "dependency computation on a large random backward graph (vectorised vs a plain walk)"


def random_graph(
    num_nodes: int, num_edges: int, *, seed: int = 0, leaf_fraction: float = 0.1, sends: int = 8
) -> tuple[BackwardGraph, list[int], list[int]]:
    """A random backward-shaped DAG: functions point to higher ids, leaves last.

    Every function node has an edge to the next node (so the graph is one deep chain, the
    shape of a deep network's backward pass) plus random edges that jump forward. A few
    ``recv`` leaves and ``send`` nodes make it a distributed context's graph.

    Returns:
        (graph, roots, sends)
    """
    if num_nodes < 4 or num_edges < num_nodes:
        raise ValueError(
            f"need num_nodes >= 4 and num_edges >= num_nodes, got {num_nodes}, {num_edges}"
        )
    rng = np.random.default_rng(seed)
    n_leaf = max(2, int(num_nodes * leaf_fraction))
    n_fn = num_nodes - n_leaf
    kinds = np.full(num_nodes, NodeKind.FUNCTION, dtype=np.int64)
    kinds[n_fn:] = NodeKind.ACCUMULATE
    kinds[n_fn : n_fn + min(sends, n_leaf // 2)] = NodeKind.RECV
    send_ids = rng.choice(np.arange(1, n_fn), size=min(sends, n_fn - 1), replace=False)
    kinds[send_ids] = NodeKind.SEND
    chain_src = np.arange(n_fn, dtype=np.int64)
    chain_dst = chain_src + 1
    extra = num_edges - n_fn
    src = rng.integers(0, n_fn, size=extra, dtype=np.int64)
    dst = np.minimum(src + 1 + rng.geometric(1e-3, size=extra), num_nodes - 1)
    # Leaves get their edges from functions near the end as well as random jumps.
    to_leaf = rng.random(extra) < leaf_fraction
    dst[to_leaf] = rng.integers(n_fn, num_nodes, size=int(to_leaf.sum()))
    all_src = np.concatenate([chain_src, src])
    all_dst = np.concatenate([chain_dst, dst])
    graph = BackwardGraph.from_arrays(kinds, all_src, all_dst)
    return graph, [0], sorted(int(s) for s in send_ids)


def plain_walk(graph: BackwardGraph, roots: list[int], sends: list[int]) -> dict[int, int]:
    """computeDependencies as the C++ reads: BFS with a seen set, one count per edge."""
    ptr = graph.indptr.tolist()
    dst = graph.dst.tolist()
    deps: dict[int, int] = {}
    seen = set(roots) | set(sends)
    queue = deque(sorted(seen))
    while queue:
        u = queue.popleft()
        for v in dst[ptr[u] : ptr[u + 1]]:
            deps[v] = deps.get(v, 0) + 1
            if v not in seen:
                seen.add(v)
                queue.append(v)
    return deps


def _duration(seconds: float) -> str:
    """Seconds in a unit that shows three significant figures: a small graph's pass took
    "0.000 s" at a fixed three decimals, which read as free (or as not measured)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{seconds / 1e-6:.3g} µs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1_000_000, help="number of nodes")
    parser.add_argument("--edges", type=int, default=2_000_000, help="number of edges")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (best kept)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the plain Python walk (slow)"
    )
    add_table_outputs(parser, "the figures (seconds, speedup)")


def run(args: argparse.Namespace) -> int:
    if args.nodes < 4 or args.edges < args.nodes or args.repeat < 1:
        raise ValueError(
            f"--nodes {args.nodes} --edges {args.edges} --repeat {args.repeat}: expected "
            "--nodes >= 4, --edges >= --nodes and --repeat >= 1"
        )
    lines: list[str] = []
    t0 = time.perf_counter()
    graph, roots, sends = random_graph(args.nodes, args.edges, seed=args.seed)
    built = time.perf_counter() - t0
    lines.append(
        f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {len(sends)} sends "
        f"(built in {_duration(built)})"
    )
    t0 = time.perf_counter()
    deps = compute_dependencies(graph, roots, sends)
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in progress(range(args.repeat), "compute_dependencies"):
        t0 = time.perf_counter()
        deps = compute_dependencies(graph, roots, sends)
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    unused = unused_parameters(graph, roots, sends)
    t_unused = time.perf_counter() - t0
    lines.append(
        f"compute_dependencies: first call {_duration(first)} (imports, caches), "
        f"best {_duration(best)}"
    )
    lines.append(
        f"  reachable {int(deps.reachable.sum()):,}, leaves {deps.leaves.size:,}, "
        f"needed {int(deps.needed.sum()):,}"
    )
    lines.append(f"unused_parameters: {_duration(t_unused)} ({len(unused):,} unused)")
    t_ref: float | None = None
    agree: bool | None = None
    if not args.no_baseline:
        t0 = time.perf_counter()
        ref = plain_walk(graph, roots, sends)
        t_ref = time.perf_counter() - t0
        table = deps.table()
        agree = all(table.get(v, 0) == c for v, c in ref.items()) and sum(table.values()) == sum(
            ref.values()
        )
        lines.append(
            f"plain Python walk: {_duration(t_ref)}; xgrad is {t_ref / best:.1f}x faster; agree: {agree}"
        )
        if not agree:
            lines.append("MISMATCH between xgrad and the plain walk")
    columns = ("nodes", "edges", "sends", "first_s", "best_s", "unused_s", "unused", "walk_s")
    row = (graph.num_nodes, graph.num_edges, len(sends), first, best, t_unused, len(unused), t_ref)
    speedup = None if t_ref is None else t_ref / best
    figures = Table((*columns, "speedup", "agree"), ((*row, speedup, agree),), "bench graph")
    print_tables(args, [figures], "\n".join(lines))
    return 1 if agree is False else 0
