"""The engine: execution order, summed gradients, hooks, errors (a local pass)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from xgrad.engine import BackwardError, Deferred, Engine, NodeFunction
from xgrad.engine_plan import reaches_recv
from xgrad.graph import BackwardGraph, GraphBuilder
from xgrad.reference import mlp_batch, mlp_weights
from xgrad.reference.models import MLP


def scale(*factors: float) -> NodeFunction:
    def fn(grads: list[Any]) -> Sequence[Any]:
        return [grads[0] * f for f in factors]

    return fn


def diamond() -> tuple[BackwardGraph, dict[int, NodeFunction]]:
    """0 -> 1 -> {2, 3 (acc w)}; 2 -> {4 (acc b), 3 (acc w)}: w gets two gradients."""
    b = GraphBuilder()
    loss = b.add_node("function", "loss")
    mul = b.add_node("function", "mul")
    add = b.add_node("function", "add")
    w = b.add_node("accumulate", "w", param=0)
    bias = b.add_node("accumulate", "b", param=1)
    b.add_edge(loss, mul)
    b.add_edge(mul, add)
    b.add_edge(mul, w)
    b.add_edge(add, bias)
    b.add_edge(add, w)
    return b.build(), {loss: scale(2.0), mul: scale(3.0, 5.0), add: scale(7.0, 11.0)}


def test_order_and_summed_gradients() -> None:
    g, fns = diamond()
    engine = Engine()
    result = engine.backward(g, fns, {0: 1.0})
    # 1 waits for 0; 3 (w) waits for both 1 and 2; ready accumulators run first, higher ids first.
    assert result.order == (0, 1, 2, 4, 3)
    assert engine.grads == {0: 2 * 5 + 2 * 3 * 11, 1: 2 * 3 * 7}


def test_mlp_backward_order_matches_autograd_priorities() -> None:
    w = mlp_weights([3, 4, 2], seed=1)
    x, y = mlp_batch([3, 4, 2], 5, seed=1)
    fp = MLP(w).forward(x, y)
    names = [fp.graph.name(u) for u in range(fp.graph.num_nodes)]
    assert names == [
        "layers.0.weight",
        "layers.0.bias",
        "LinearBackward[0]",
        "TanhBackward[0]",
        "layers.1.weight",
        "layers.1.bias",
        "LinearBackward[1]",
        "MseLossBackward",
    ]
    engine = Engine()
    result = engine.backward(fp.graph, fp.functions, {fp.root: np.ones(())})
    assert result.order == (7, 6, 5, 4, 3, 2, 1, 0)
    # Gradients against central differences of the loss.
    eps = 1e-6
    for name in ("layers.0.weight", "layers.1.bias"):
        i = list(w).index(name)
        k = (0,) * w[name].ndim
        plus = {n: a.copy() for n, a in w.items()}
        minus = {n: a.copy() for n, a in w.items()}
        plus[name][k] += eps
        minus[name][k] -= eps
        numeric = (MLP(plus).forward(x, y).loss - MLP(minus).forward(x, y).loss) / (2 * eps)
        assert engine.grads[i][k] == pytest.approx(float(numeric), rel=1e-6)


def test_post_accumulate_hooks_see_accumulated_gradients() -> None:
    g, fns = diamond()
    engine = Engine()
    seen: list[tuple[int, float]] = []
    remove = engine.register_post_accumulate_hook(0, lambda i, grad: seen.append((i, grad)))
    engine.register_post_accumulate_hook(1, lambda i, grad: seen.append((i, grad)))
    engine.backward(g, fns, {0: 1.0})
    engine.backward(g, fns, {0: 1.0})
    assert seen == [(1, 42.0), (0, 76.0), (1, 84.0), (0, 152.0)]
    remove()
    engine.zero_grad()
    seen.clear()
    engine.backward(g, fns, {0: 1.0})
    assert seen == [(1, 42.0)]


def test_accumulation_is_in_place_after_a_private_copy() -> None:
    g, fns = diamond()
    engine = Engine()
    root = np.ones(2)
    engine.backward(g, fns, {0: root})
    first = engine.grads[0]
    engine.backward(g, fns, {0: root})
    assert engine.grads[0] is first
    assert engine.grads[0].tolist() == [152.0, 152.0]
    assert root.tolist() == [1.0, 1.0]


def test_outputs_restrict_what_runs() -> None:
    g, fns = diamond()
    engine = Engine()
    result = engine.backward(g, fns, {0: 1.0}, outputs=[4])
    assert result.order == (0, 1, 2, 4)
    assert engine.grads == {1: 42.0}


def test_first_error_stops_the_pass_and_the_next_pass_works() -> None:
    g, fns = diamond()

    def broken(grads: list[Any]) -> Sequence[Any]:
        raise FloatingPointError("overflow in add")

    engine = Engine()
    with pytest.raises(BackwardError, match=r"at node 2 \(add\): FloatingPointError") as info:
        engine.backward(g, {**fns, 2: broken}, {0: 1.0})
    assert (info.value.node, info.value.node_name, info.value.worker) == (2, "add", None)
    assert info.value.message == "FloatingPointError: overflow in add"
    engine.zero_grad()
    assert engine.backward(g, fns, {0: 1.0}).order == (0, 1, 2, 4, 3)
    assert engine.grads == {0: 76.0, 1: 42.0}


def test_deferred_gradients_run_once_nothing_else_is_ready() -> None:
    g, fns = diamond()
    log: list[str] = []

    def logged(name: str, fn: NodeFunction) -> NodeFunction:
        def run(grads: list[Any]) -> Sequence[Any]:
            log.append(name)
            return fn(grads)

        return run

    def mul(grads: list[Any]) -> Sequence[Any]:
        log.append("mul")

        def for_w() -> list[Any]:  # deferred: the B/W split of a zero-bubble schedule
            log.append("w later")
            return [grads[0] * 5.0]

        return [grads[0] * 3.0, Deferred(for_w)]

    engine = Engine()
    fns = {0: logged("loss", fns[0]), 1: mul, 2: logged("add", fns[2])}
    result = engine.backward(g, fns, {0: 1.0})
    # add and the bias's accumulator (4) ran before the deferred part, w (3) after it.
    assert log == ["loss", "mul", "add", "w later"]
    assert result.order == (0, 1, 2, 4, 3)
    assert engine.grads == {0: 76.0, 1: 42.0}  # as without the deferral


def test_one_deferred_part_may_stand_at_several_places() -> None:
    b = GraphBuilder()
    root = b.add_node("function", "root")
    accs = [b.add_node("accumulate", f"p{i}", param=i) for i in range(3)]
    for a in accs:
        b.add_edge(root, a)
    part = Deferred(lambda: [10.0, 30.0])  # for places 0 and 2, in that order
    engine = Engine()
    engine.backward(b.build(), {root: lambda grads: [part, 20.0, part]}, {root: 1.0})
    assert engine.grads == {0: 10.0, 1: 20.0, 2: 30.0}


def test_a_failing_or_short_deferred_part_names_its_node_and_the_next_pass_works() -> None:
    g, fns = diamond()

    def boom() -> Sequence[Any]:
        raise ArithmeticError("deferred boom")

    engine = Engine()
    with pytest.raises(BackwardError, match=r"at node 1 \(mul\): ArithmeticError: deferred boom"):
        engine.backward(g, {**fns, 1: lambda grads: [grads[0], Deferred(boom)]}, {0: 1.0})
    with pytest.raises(BackwardError, match="a deferred part returned 0 gradients for 1 next"):
        engine.backward(g, {**fns, 1: lambda grads: [grads[0], Deferred(lambda: [])]}, {0: 1.0})
    engine.zero_grad()
    engine.backward(g, fns, {0: 1.0})
    assert engine.grads == {0: 76.0, 1: 42.0}


def test_wrong_outputs_and_missing_functions_are_errors() -> None:
    g, fns = diamond()
    engine = Engine()
    with pytest.raises(BackwardError, match="returned 1 gradients for 2 next edges"):
        engine.backward(g, {**fns, 1: scale(3.0)}, {0: 1.0})
    with pytest.raises(BackwardError, match="no backward function was given for node 1"):
        engine.backward(g, {0: fns[0], 2: fns[2]}, {0: 1.0})


def test_hook_errors_name_the_accumulator() -> None:
    g, fns = diamond()
    engine = Engine()

    def hook(i: int, grad: Any) -> None:
        raise RuntimeError(f"marked param {i} twice")

    engine.register_post_accumulate_hook(1, hook)
    with pytest.raises(BackwardError, match=r"at node 4 \(b\): RuntimeError: marked param 1"):
        engine.backward(g, fns, {0: 1.0})


def test_the_errors_and_the_context_are_still_importable_from_the_engine() -> None:
    from xgrad import dist_context, engine, engine_errors

    assert engine.BackwardError is engine_errors.BackwardError
    assert engine.DistBackwardError is engine_errors.DistBackwardError
    assert engine.DistContext is dist_context.DistContext


def test_cached_plans_follow_roots_and_outputs_and_never_go_stale() -> None:
    # One graph object, passes from different roots and outputs interleaved: each must give
    # what the same pass gives on a fresh copy of the graph (whose cache is empty).
    g, fns = diamond()

    def fresh() -> BackwardGraph:
        return BackwardGraph.from_arrays(
            g.kinds, g.src, g.dst, input_nr=g.input_nr, params=g.params, names=g.names
        )

    cases: list[tuple[dict[int, float], list[int] | None]] = [
        ({0: 1.0}, None),
        ({2: 1.0}, None),
        ({0: 1.0}, [4]),
        ({1: 2.0}, [3]),
        ({0: 1.0, 2: 0.5}, None),
    ]
    for _ in range(3):
        for roots, outputs in cases:
            engine, reference = Engine(), Engine()
            got = engine.backward(g, fns, roots, outputs=outputs)
            want = reference.backward(fresh(), fns, roots, outputs=outputs)
            assert got.order == want.order
            assert engine.grads == reference.grads
    assert len(g._cache["engine_plans"]) == len(cases)


def test_plans_are_bounded_and_a_failing_plan_is_not_cached() -> None:
    b = GraphBuilder()
    heads = [b.add_node("function", f"f{i}") for i in range(40)]
    w = b.add_node("accumulate", "w", param=0)
    for h in heads:
        b.add_edge(h, w)
    g = b.build()
    fns = {h: scale(1.0) for h in heads}
    for h in heads:
        engine = Engine()
        engine.backward(g, fns, {h: 1.0})
        assert engine.grads == {0: 1.0}
    assert 0 < len(g._cache["engine_plans"]) <= 16
    dangling = GraphBuilder()
    dangling.add_node("function", "loss")
    bad = dangling.build()
    for _ in range(2):  # the same error each time, from the dependency computation
        with pytest.raises(ValueError, match="has no outgoing edges"):
            Engine().backward(bad, {0: scale()}, {0: 1.0})
    assert not bad._cache.get("engine_plans")


def test_reaches_recv_marks_the_nodes_a_recv_is_reached_from() -> None:
    b = GraphBuilder()
    root = b.add_node("function", "root")
    mm = b.add_node("function", "mm")
    tanh = b.add_node("function", "tanh")
    recv = b.add_node("recv", "recv from rank 0")
    w = b.add_node("accumulate", "w", param=0)
    t = b.add_node("function", "t")
    b.add_edge(root, tanh)
    b.add_edge(tanh, mm)
    b.add_edge(mm, recv)
    b.add_edge(mm, t)
    b.add_edge(t, w)
    graph = b.build()
    assert reaches_recv(graph) == [True, True, True, True, False, False]
    assert reaches_recv(graph) is reaches_recv(graph)  # cached on the immutable graph
