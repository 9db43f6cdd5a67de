"""Every way to wait for a pass's messages and to end it; a peer lost while others wait.

Rank 0 sends one tensor to each other rank, so its gradients come from several peers
(a thread per peer) and it leads the end of the pass; the others wait for rank 0 on
their own thread. Each way to wait (the caller's thread, or a thread per peer) and to
end a pass (through the leader, or every rank telling every other) gives the same
gradients, and a failure in a node reaches every rank with the next pass working; a
peer that dies or freezes while rank 0 waits on it and rank 1 on rank 0 is named within
its heartbeat timeout, and the watchdog's error for a frozen peer leaves no reference cycle.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from failing import failing_function
from ranks import run_ranks

FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
MODES = [("caller", "leader"), ("caller", "all"), ("threads", "leader"), ("threads", "all")]


Boom = failing_function("Boom", lambda: ZeroDivisionError("boom"))


def _star(rank: int, world: int, da: Any, fail: bool = False) -> list[float]:
    """0 -> every rank -> back to 0; returns rank 0's weight's gradient (others: [])."""
    import torch

    g = torch.Generator().manual_seed(rank)
    w = torch.randn(3, dtype=torch.float64, generator=g).requires_grad_()
    with da.context(timeout=20) as cid:
        if rank == 0:
            h = torch.tanh(w * 2)
            for peer in range(1, world):
                da.send(h, peer)
            loss = sum((da.recv(peer) * h).sum() for peer in range(1, world))
            da.backward(cid, [loss])
            return da.get_gradients(cid)[w].tolist()
        y = da.recv(0) * w
        if fail and rank == 1:
            y = Boom.apply(y)
        da.send(y, 0)
        da.backward(cid, [])
        return []


def _modes(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da
    from xgrad.torch_backend import dist_inbox

    os.environ.update(FAST_HEARTBEAT)
    out: dict[str, Any] = {}
    for wait, done in MODES:
        dist_inbox.WAIT, da.DONE_VIA = wait, done
        out[f"{wait}/{done}"] = _star(rank, world, da)
        try:
            _star(rank, world, da, fail=True)
            out[f"{wait}/{done}/fail"] = "no error"
        except da.DistBackwardError as exc:
            out[f"{wait}/{done}/fail"] = (str(exc), exc.rank)
        out[f"{wait}/{done}/after"] = _star(rank, world, da)
    return out


def test_every_way_to_wait_and_end_gives_the_same_gradients_and_errors() -> None:
    results, codes = run_ranks(_modes, 3, timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    outs = {rank: value for rank, (status, value) in results.items() if status == "ok"}
    assert len(outs) == 3, results
    first = outs[0]["caller/leader"]
    assert len(first) == 3
    for wait, done in MODES:
        key = f"{wait}/{done}"
        # Equal up to the order the two peers' gradients landed in (summed as they come).
        assert outs[0][key] == pytest.approx(first, rel=1e-12, abs=1e-12), key
        assert outs[0][f"{key}/after"] == pytest.approx(first, rel=1e-12, abs=1e-12), key
        for rank in range(3):
            msg, origin = outs[rank][f"{key}/fail"]
            assert origin == 1, (key, rank, msg)
            assert msg.startswith("Error on rank 1 in BoomBackward: ZeroDivisionError"), msg


def _lost(rank: int, world: int, how: str) -> tuple[str, int, float, list[str]]:
    """Rank 2 dies or freezes after the forward pass while rank 0 waits on both peers;
    also what the pass left for the garbage collector (see ``test_torch_cycles``)."""
    from garbage import xgrad_garbage

    from xgrad.torch_backend import dist_threads

    found: dict[str, Any] = {}
    with xgrad_garbage(found):
        msg, origin, elapsed = _lost_pass(rank, how)
        for t in list(dist_threads._made):  # the threads that wait out a failed pass
            if t.drain:
                t.thread.join(5.0)
    return msg, origin, elapsed, found["garbage"]


def _lost_pass(rank: int, how: str) -> tuple[str, int, float]:
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with da.context(timeout=20) as cid:
        if rank == 0:
            h = w * 2
            da.send(h, 1)
            da.send(h, 2)
        else:
            y = da.recv(0)
        start = time.monotonic()
        if rank == 2:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            da.backward(cid, [] if rank == 0 else [(y * w).sum()])
        except da.DistBackwardError as exc:
            return str(exc), exc.rank, time.monotonic() - start
    return "no error", -1, time.monotonic() - start


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_peer_lost_during_a_wait_on_several_is_named(how: str) -> None:
    results, codes = run_ranks(_lost, 3, args=(how,), timeout=90, frozen=[2])
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        msg, origin, elapsed, garbage = value
        assert msg.startswith("Error on rank 2: stopped answering"), msg
        # The receives left posted are waited out without a reference cycle.
        assert garbage == [], (rank, garbage)
        assert origin == 2
        assert elapsed < 2.0 + 8.0  # heartbeat timeout 2 s, on a loaded machine
        assert codes[rank] == 0


def _caught_here(rank: int, world: int) -> tuple[str, list[str]]:
    """Rank 1 freezes while rank 0 waits for its message on this thread: the watchdog's
    error, raised by ``wait_here``; and what that left for the garbage collector once the
    watchdog thread is gone."""
    import torch
    import torch.distributed as dist
    from garbage import xgrad_garbage

    from xgrad.failure import RankError
    from xgrad.torch_backend import dist_watch
    from xgrad.torch_backend.failure import failure_channel

    os.environ.update(FAST_HEARTBEAT)
    channel = failure_channel(None, "caught-here")
    dist.barrier()  # both heartbeats seen before rank 1 stops
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    pg = dist.distributed_c10d._get_default_group()
    work = pg.recv([torch.empty(1)], 1, 0)
    dist_watch._WATCHDOG.IDLE_EXIT = 0.0  # the thread ends at its next idle poll
    found: dict[str, Any] = {}
    with xgrad_garbage(found):
        try:
            dist_watch.wait_here(work, channel, pg, 1, 20.0, "recv from rank 1", 1)
            msg = "no error"
        except RankError as exc:
            msg = f"{type(exc).__name__}: {exc}"
        watchdog = dist_watch._WATCHDOG._thread
        if watchdog is not None:
            watchdog.join(5.0)
    return msg, found["garbage"]


def test_a_frozen_peer_caught_by_the_watchdog_leaves_no_cycle() -> None:
    results, _ = run_ranks(_caught_here, 2, timeout=60, frozen=[1])
    status, value = results[0]
    assert status == "ok", value
    msg, garbage = value
    assert msg.startswith("RankUnresponsiveError: rank 1: stopped answering"), msg
    assert garbage == [], garbage


def test_the_watchdog_lets_go_of_a_wait_once_it_ended() -> None:
    """A wait the watchdog looked at (it lasted past the poll interval) is not kept alive by
    the watchdog thread after it ended: not its group, not its channel."""
    import gc
    import weakref

    from xgrad.failure import default_seconds
    from xgrad.torch_backend import dist_watch

    class Channel:
        checked = 0

        def check(self) -> None:
            Channel.checked += 1

    class Group:
        pass

    watchdog = dist_watch._Watchdog()
    watch = dist_watch._Watch(Channel(), Group(), 1)  # type: ignore[arg-type]
    refs = [weakref.ref(watch), weakref.ref(watch.channel), weakref.ref(watch.pg)]
    watchdog.begin(watch)
    poll = default_seconds("poll_interval")
    deadline = time.monotonic() + 5.0
    while Channel.checked == 0 and time.monotonic() < deadline:
        time.sleep(poll)
    assert Channel.checked > 0  # the watchdog read the channel for this wait
    watchdog.end()
    del watch
    time.sleep(3 * poll)  # the watchdog's next polls; it lives on (IDLE_EXIT)
    gc.collect()
    assert watchdog._thread is not None and watchdog._thread.is_alive()
    assert [r() for r in refs] == [None, None, None]


def _frozen_after_send(rank: int, world: int) -> Any:
    """Rank 0 sends, then freezes before rank 1 posts its receive (1.5 s later)."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with da.context(timeout=30) as cid:
        if rank == 0:
            da.send(w * 2, 1)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1.5)
        start = time.monotonic()
        try:
            da.recv(0)
        except da.DistBackwardError as exc:
            return str(exc), exc.rank, time.monotonic() - start
        da.backward(cid, [])
    return "no error"


def test_a_sender_frozen_before_its_receive_was_posted_is_named_by_its_heartbeat() -> None:
    """The header had landed, so the receive waited for the data on its own thread, without
    the watchdog; gloo moves the data only once the receive is posted, through the sender's
    communication thread, which a frozen sender does not run: the wait ran out the
    context's timeout (30 s) instead of the heartbeat's (2 s)."""
    results, _ = run_ranks(_frozen_after_send, 2, timeout=90, frozen=[0])
    status, out = results[1]
    assert status == "ok", out
    text, origin, seconds = out
    assert origin == 0 and text.startswith("Error on rank 0: stopped answering"), out
    assert seconds < 12.0, out  # the heartbeat timeout is 2 s, the context's 30 s
