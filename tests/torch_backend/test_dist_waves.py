"""The wave plan of a rank's graph, and a failing wave named by its node (one process).

The passes themselves run across real processes in ``test_torch_dist_autograd.py`` (on
both executions, the failures on waves); here: which recvs and leaves each output reaches
and how many outputs each waits for, and the anomaly-mode rerun that names a failing node.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from failing import failing_function  # noqa: E402

from xgrad.torch_backend.dist_edges import received  # noqa: E402
from xgrad.torch_backend.dist_graph import build_rank_graph  # noqa: E402
from xgrad.torch_backend.dist_waves import _named, plan_waves  # noqa: E402


def test_each_output_reaches_its_recvs_and_leaves_and_each_waits_for_all_of_them() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    r, r_node = received(torch.randn(3, generator=g, dtype=torch.float64))
    _q, q_node = received(torch.randn(3, generator=g, dtype=torch.float64))  # unused
    h = torch.tanh(r * w)  # sent (twice), and in the root
    s = u * 2  # sent: reaches u only
    root = (h * r).sum()
    rg = build_rank_graph([root], [(h, "a"), (h, "b"), (s, "c")], [(r_node, "r"), (q_node, "q")])
    root_node = next(iter(rg.grad_roots))
    plan = plan_waves(rg.graph, root_node, rg.send_nodes)
    (recv_r,) = [n for n, i in rg.recv_nodes.items() if i == 0]
    assert 1 not in rg.recv_nodes.values()  # q: no output reaches it
    leaf = {id(t): i for i, t in enumerate(rg.leaves)}
    a, b, c = rg.send_nodes
    assert plan.recvs[root_node] == plan.recvs[a] == plan.recvs[b] == (recv_r,)
    assert plan.recvs[c] == ()
    assert plan.leaves[a] == (leaf[id(w)],) and plan.leaves[c] == (leaf[id(u)],)
    assert plan.recv_waits == {recv_r: 3}
    assert plan.leaf_waits == {leaf[id(w)]: 3, leaf[id(u)]: 1}
    # The plan is cached with the graph's structure: the next pass's graph reuses it.
    h2 = torch.tanh(r * w)
    again = build_rank_graph(
        [(h2 * r).sum()], [(h2, "a"), (h2, "b"), (u * 2, "c")], [(r_node, "r")]
    )
    assert plan_waves(again.graph, next(iter(again.grad_roots)), again.send_nodes) is plan


_Fails = failing_function("_Fails", lambda: ValueError("no"))


def test_a_failing_wave_is_named_by_its_node() -> None:
    w = torch.ones(2, requires_grad=True)
    y = _Fails.apply(w * 3).sum()
    with pytest.raises(ValueError):
        torch.autograd.grad([y], [w], retain_graph=True)
    assert _named([y], [w], [torch.ones(())]) == "_FailsBackward"
    w.register_hook(lambda g: 1 / 0)
    assert _named([(w * 2).sum()], [w], [torch.ones(())]) == "AccumulateGrad"
    # A wave that does not fail again when rerun: the pass is named, not a node.
    assert _named([(w * 0).sum()], [torch.zeros(1, requires_grad=True)], [None]) == "backward"
