"""Distributed passes: gradients back through recv/send, one error everywhere, cleanup, timeouts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from xgrad.dist_context import DistContext
from xgrad.engine import Engine, NodeFunction
from xgrad.engine_errors import DistBackwardError
from xgrad.graph import BackwardGraph
from xgrad.graph_builder import GraphBuilder
from xgrad.reference import ReferenceComm, spawn


def scale(*factors: float) -> NodeFunction:
    def fn(grads: list[Any]) -> Sequence[Any]:
        return [grads[0] * f for f in factors]

    return fn


def two_worker_graphs() -> tuple[BackwardGraph, BackwardGraph]:
    """Worker 0 received tensor t from worker 1 and used it; worker 1 made t from p1.

    worker 0:  0 loss ─► 1 recv(t)          worker 1:  0 send(t) ─► 1 f ─► 2 acc p1
                  └────► 2 acc p0
    """
    b0 = GraphBuilder()
    loss = b0.add_node("function", "loss")
    recv = b0.add_node("recv", "recv t")
    p0 = b0.add_node("accumulate", "p0", param=0)
    b0.add_edge(loss, recv)
    b0.add_edge(loss, p0)
    b1 = GraphBuilder()
    send = b1.add_node("send", "send t")
    f = b1.add_node("function", "f")
    p1 = b1.add_node("accumulate", "p1", param=1)
    b1.add_edge(send, f)
    b1.add_edge(f, p1)
    return b0.build(), b1.build()


def run_two_workers(
    engines: list[Engine], ctx: DistContext, fail_on: int | None = None
) -> list[Any]:
    g0, g1 = two_worker_graphs()

    def f(grads: list[Any]) -> Sequence[Any]:
        if fail_on == 1:
            raise ValueError("bad shard on worker 1")
        return [grads[0] * 10.0]

    def loss(grads: list[Any]) -> Sequence[Any]:
        if fail_on == 0:
            raise ValueError("bad loss on worker 0")
        return [grads[0] * 3.0, grads[0] * 2.0]

    def rank_main(comm: ReferenceComm) -> Any:
        w = comm.rank
        try:
            if w == 0:
                return engines[0].backward_distributed(ctx, 0, g0, {0: loss}, {0: 1.0})
            return engines[1].backward_distributed(ctx, 1, g1, {1: f})
        except DistBackwardError as err:
            return err

    return spawn(rank_main, 2, timeout=10.0)


def test_distributed_pass_sends_gradients_back() -> None:
    engines = [Engine(), Engine()]
    ctx = DistContext([0, 1])
    ctx.link(send_worker=1, send_node=0, recv_worker=0, recv_node=1)
    r0, r1 = run_two_workers(engines, ctx)
    assert r0.order == (0, 2, 1) and r1.order == (0, 1, 2)
    assert r0.context_id == r1.context_id == ctx.context_id
    assert engines[0].grads == {0: 2.0}
    assert engines[1].grads == {1: 30.0}
    assert ctx.released and not engines[0].contexts and not engines[1].contexts


@pytest.mark.parametrize("fail_on", [0, 1])
def test_an_error_on_one_worker_reaches_every_worker_and_is_cleaned_up(fail_on: int) -> None:
    engines = [Engine(), Engine()]
    ctx = DistContext([0, 1], timeout=10.0)
    ctx.link(1, 0, 0, 1)
    errors = run_two_workers(engines, ctx, fail_on=fail_on)
    for raised_on, err in enumerate(errors):
        assert isinstance(err, DistBackwardError)
        assert err.worker == fail_on and err.raised_on == raised_on
        assert f"on worker {fail_on}" in str(err) and "ValueError: bad" in str(err)
        assert err.context_id == ctx.context_id
    assert ctx.released and not engines[0].contexts and not engines[1].contexts
    # The next pass, on the same engines, works.
    for e in engines:
        e.zero_grad()
    ctx2 = DistContext([0, 1])
    ctx2.link(1, 0, 0, 1)
    run_two_workers(engines, ctx2)
    assert engines[1].grads == {1: 30.0} and engines[0].grads == {0: 2.0}
    assert ctx2.context_id != ctx.context_id


def test_a_worker_that_never_joins_times_out_naming_the_waiting_worker() -> None:
    g0, _ = two_worker_graphs()
    engine = Engine()
    ctx = DistContext([0, 1], timeout=0.3)
    ctx.link(1, 0, 0, 1)
    with pytest.raises(DistBackwardError, match=r"on worker 0.*workers \[1\] did not finish"):
        engine.backward_distributed(ctx, 0, g0, {0: scale(3.0, 2.0)}, {0: 1.0})
    assert not engine.contexts


def test_recv_outside_a_context_is_refused() -> None:
    g0, _ = two_worker_graphs()
    with pytest.raises(ValueError, match=r"recv node 1 .* not linked"):
        Engine().backward(g0, {0: scale(3.0, 2.0)}, {0: 1.0})


def chain_graphs() -> list[BackwardGraph]:
    """Worker 0 sends t0 to worker 1, which sends t1 = f(t0, p1) to worker 2 (the loss).

    worker 2: 0 loss ─► 1 recv(t1)    worker 1: 0 send(t1) ─► 1 f ─► 2 recv(t0)
                 └────► 2 acc p2                                └────► 3 acc p1
    worker 0: 0 send(t0) ─► 1 g ─► 2 acc p0
    """
    b0, b1, b2 = GraphBuilder(), GraphBuilder(), GraphBuilder()
    s0, g, p0 = (
        b0.add_node("send"),
        b0.add_node("function", "g"),
        b0.add_node("accumulate", "p0", 0),
    )
    b0.add_edge(s0, g)
    b0.add_edge(g, p0)
    s1, f = b1.add_node("send"), b1.add_node("function", "f")
    r0, p1 = b1.add_node("recv"), b1.add_node("accumulate", "p1", 1)
    b1.add_edge(s1, f)
    b1.add_edge(f, r0)
    b1.add_edge(f, p1)
    loss, r1, p2 = (
        b2.add_node("function", "loss"),
        b2.add_node("recv"),
        b2.add_node("accumulate", "p2", 2),
    )
    b2.add_edge(loss, r1)
    b2.add_edge(loss, p2)
    return [b0.build(), b1.build(), b2.build()]


def test_three_workers_in_a_chain() -> None:
    graphs = chain_graphs()
    ctx = DistContext([0, 1, 2])
    ctx.link(send_worker=1, send_node=0, recv_worker=2, recv_node=1)
    ctx.link(send_worker=0, send_node=0, recv_worker=1, recv_node=2)
    fns: list[dict[int, NodeFunction]] = [
        {1: scale(11.0)},
        {1: scale(5.0, 7.0)},
        {0: scale(2.0, 3.0)},
    ]
    roots: list[dict[int, Any]] = [{}, {}, {0: 1.0}]
    engines = [Engine() for _ in range(3)]

    def body(comm: ReferenceComm) -> Any:
        r = comm.rank
        return engines[r].backward_distributed(ctx, r, graphs[r], fns[r], roots[r])

    orders = [res.order for res in spawn(body, 3, timeout=10.0)]
    assert orders == [(0, 1, 2), (0, 1, 3, 2), (0, 2, 1)]
    assert [e.grads for e in engines] == [{0: 110.0}, {1: 14.0}, {2: 3.0}]


def test_an_unreached_recv_tells_its_sender_there_is_no_gradient() -> None:
    # Worker 0's loss does not use the tensor it received: worker 1's send gets None.
    b0 = GraphBuilder()
    loss, recv, p0 = (
        b0.add_node("function"),
        b0.add_node("recv"),
        b0.add_node("accumulate", "p0", 0),
    )
    b0.add_edge(loss, p0)
    _, g1 = two_worker_graphs()
    ctx = DistContext([0, 1])
    ctx.link(1, 0, 0, recv)
    engines = [Engine(), Engine()]
    hooked: list[Any] = []
    engines[1].register_post_accumulate_hook(1, lambda i, grad: hooked.append(grad))

    def never(grads: list[Any]) -> Sequence[Any]:
        raise AssertionError("a node without gradients must not be called")

    def body(comm: ReferenceComm) -> Any:
        if comm.rank == 0:
            return engines[0].backward_distributed(ctx, 0, b0.build(), {0: scale(4.0)}, {0: 1.0})
        return engines[1].backward_distributed(ctx, 1, g1, {1: never})

    r0, r1 = spawn(body, 2, timeout=10.0)
    assert r0.order == (0, 2) and r1.order == (0, 1, 2)
    assert engines[0].grads == {0: 4.0} and engines[1].grads == {}
    assert hooked == [None]


def test_a_bad_graph_on_one_worker_fails_the_others_at_once() -> None:
    g0, g1 = two_worker_graphs()
    ctx = DistContext([0, 1], timeout=30.0)  # worker 0 forgets the link: its recv is unlinked
    engines = [Engine(), Engine()]

    def body(comm: ReferenceComm) -> Any:
        try:
            if comm.rank == 0:
                engines[0].backward_distributed(ctx, 0, g0, {0: scale(3.0, 2.0)}, {0: 1.0})
            else:
                engines[1].backward_distributed(ctx, 1, g1, {1: scale(10.0)})
        except DistBackwardError as err:
            return err

    errors = spawn(body, 2, timeout=30.0)
    assert [e.worker for e in errors] == [0, 0]
    assert all("ValueError: recv node 1" in str(e) for e in errors)


def test_a_context_refuses_to_be_pickled_and_says_what_works_across_processes() -> None:
    import pickle

    import pytest

    from xgrad.dist_context import DistContext

    with pytest.raises(TypeError, match=r"xgrad\.torch_backend\.dist_autograd"):
        pickle.dumps(DistContext([0, 1]))


@pytest.mark.parametrize("peer_first", [True, False])
def test_work_toward_a_peer_goes_before_a_ready_recv_and_leaf_work_after(
    peer_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 0: loss -> {recv a, g -> recv b, h -> acc p0}; worker 1 sent both a and b.

    With ``PEER_FIRST`` g (toward recv b) runs before the ready recv a, and h (leaves
    only) after both recvs; without it, later-created nodes first, as a local pass.
    """
    from xgrad import engine_plan

    monkeypatch.setattr(engine_plan, "PEER_FIRST", peer_first)
    b0 = GraphBuilder()
    loss = b0.add_node("function", "loss")
    recv_a = b0.add_node("recv", "recv a")
    g = b0.add_node("function", "g")
    recv_b = b0.add_node("recv", "recv b")
    h = b0.add_node("function", "h")
    p0 = b0.add_node("accumulate", "p0", param=0)
    for u, v in ((loss, recv_a), (loss, g), (g, recv_b), (loss, h), (h, p0)):
        b0.add_edge(u, v)
    b1 = GraphBuilder()
    send_a = b1.add_node("send", "send a")
    send_b = b1.add_node("send", "send b")
    p1 = b1.add_node("accumulate", "p1", param=1)
    b1.add_edge(send_a, p1)
    b1.add_edge(send_b, p1)
    graphs = (b0.build(), b1.build())
    ctx = DistContext([0, 1])
    ctx.link(send_worker=1, send_node=send_a, recv_worker=0, recv_node=recv_a)
    ctx.link(send_worker=1, send_node=send_b, recv_worker=0, recv_node=recv_b)
    engines = [Engine(), Engine()]
    fns = {loss: scale(1.0, 2.0, 3.0), g: scale(5.0), h: scale(7.0)}

    def rank_main(comm: ReferenceComm) -> Any:
        if comm.rank == 0:
            return engines[0].backward_distributed(ctx, 0, graphs[0], fns, {loss: 1.0})
        return engines[1].backward_distributed(ctx, 1, graphs[1], {})

    r0, _ = spawn(rank_main, 2, timeout=10.0)
    if peer_first:
        assert r0.order == (loss, g, recv_b, recv_a, h, p0)
    else:
        assert r0.order == (loss, h, p0, g, recv_b, recv_a)  # later-created first
    assert engines[1].grads == {1: 1.0 + 2.0 * 5.0} and engines[0].grads == {0: 21.0}
