"""A rank that runs fewer distributed autograd contexts than its peers, then leaves.

Rank 1 runs one context and leaves: it returns (the launcher then destroys the group and
the process ends), destroys the group itself and lives on, or its process ends with the
group; rank 0 goes on to a second context and waits for rank 1 there, in a forward
``recv``, for its gradients, or only for its end of the pass. Rank 0 named it a heartbeat
timeout later as a rank that "stopped answering", or through gloo's "Connection reset by
peer", or, after a ``destroy_process_group`` with rank 1's heartbeat still beating, blamed
itself ("every rank still answers: the group's connection was closed earlier"). Now rank
1 posts, as it leaves, that it left after 1 context, and rank 0 raises that at once. A
rank killed after its last context is still named as one that stopped answering.

The heartbeat timeout is left at its default (10 s) where a rank leaves, so that an error
within 3 s is the leave's post, not the heartbeat's.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from ranks import run_ranks

FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
#: how long rank 1 waits before it leaves: rank 0 is waiting for it in its next context.
LINGER = 0.5
LEFT = (
    "Error on rank 1: left after 1 distributed autograd context on process group '0' "
    "({how}): it never enters the group's context 2, in which the other ranks wait for it"
)


def _step(rank: int, da: Any, mode: str) -> list[float]:
    """One context in which rank 0 waits for rank 1 in a ``recv`` (``mode`` "recv"), for
    the gradient of a tensor it sent ("send"), or only for rank 1's end of the pass
    ("backward"); rank 0's weight's gradient (rank 1: [])."""
    import torch

    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with da.context(timeout=20) as cid:
        if rank == 0:
            h = w * 2
            if mode == "send":
                da.send(h, 1)
                loss = (h * h).sum()
            elif mode == "recv":
                loss = (da.recv(1) * h).sum()
            else:
                loss = (h * h).sum()
            da.backward(cid, [loss])
            return da.get_gradients(cid)[w].tolist()
        if mode == "recv":
            da.send(w * 3, 0)
            da.backward(cid, [])
        elif mode == "send":
            da.backward(cid, [(da.recv(0) * w).sum()])
        else:
            da.backward(cid, [(w * w).sum()])
        return []


def _leaver(rank: int, world: int, how: str, mode: str) -> Any:
    """Rank 1 runs one context, then leaves as ``how`` says; rank 0 runs two: what its
    second raised (text, origin, type) and how long after it began."""
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    if how == "kill":
        os.environ.update(FAST_HEARTBEAT)
    first = _step(rank, da, mode)
    if rank == 1:
        time.sleep(LINGER)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "destroy":
            dist.destroy_process_group()
            time.sleep(3.0)  # alive, its heartbeat beating, its group gone
        elif how == "exit":
            # The launcher's destroy_process_group after the return does nothing: the
            # process ends with the group (multiprocessing ends it with os._exit).
            dist.destroy_process_group = lambda *args, **kwargs: None
        return first
    start = time.monotonic()
    try:
        _step(rank, da, mode)
    except da.DistBackwardError as exc:
        return str(exc), exc.rank, type(exc).__name__, time.monotonic() - start
    return "no error"


def _left(how: str, mode: str) -> tuple[str, float]:
    results, codes = run_ranks(_leaver, 2, args=(how, mode), timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    text, origin, kind, seconds = out
    assert origin == 1, out
    assert kind == "DistBackwardUnresponsiveError", out
    return text, seconds


@pytest.mark.parametrize("mode", ["recv", "send", "backward"])
def test_a_rank_that_returned_after_fewer_contexts_is_named_as_left(mode: str) -> None:
    """Was "Error on rank 1: stopped answering: no heartbeat for 10 s" (recv), or "stopped
    answering while rank 0 waited in backward, ...: Connection reset by peer" (send,
    backward)."""
    text, seconds = _left("return", mode)
    assert text.startswith(LEFT.format(how="it destroyed the group with destroy_process_group"))
    assert "stopped answering" not in text and "Connection" not in text, text
    assert seconds < LINGER + 2.5, (seconds, text)


def test_a_rank_that_destroyed_the_group_and_lives_on_is_named_as_left() -> None:
    """Was "Error on rank 0 in backward, waiting for ranks [1] to finish: RuntimeError:
    ... Connection closed by peer ... (every rank still answers: ...)" after 3 s: the
    waiting rank named, as rank 1 still beat."""
    text, seconds = _left("destroy", "backward")
    assert text.startswith(LEFT.format(how="it destroyed the group with destroy_process_group"))
    assert "rank 0" not in text, text
    assert seconds < LINGER + 2.5, (seconds, text)


def test_a_rank_whose_process_ended_with_the_group_is_named_as_left() -> None:
    """Was "Error on rank 1: stopped answering: no heartbeat for 10 s" after 10 s."""
    text, seconds = _left("exit", "recv")
    assert text.startswith(LEFT.format(how="its process ended")), text
    assert seconds < LINGER + 2.5, (seconds, text)


def test_a_rank_killed_after_its_last_context_is_still_named_as_stopped() -> None:
    results, codes = run_ranks(_leaver, 2, args=("kill", "backward"), timeout=90, frozen=[1])
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    text, origin, kind, seconds = out
    assert (origin, kind) == (1, "DistBackwardUnresponsiveError"), out
    assert text.startswith("Error on rank 1: stopped answering"), text
    assert "left" not in text, text
    assert seconds < LINGER + 2.0 + 8.0, out  # heartbeat timeout 2 s, on a loaded machine


def _inside(rank: int, world: int) -> Any:
    """Rank 1 destroys the group inside its second context, which rank 0 waits in."""
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    _step(rank, da, "recv")
    if rank == 1:
        try:
            with da.context(timeout=20):
                time.sleep(LINGER)
                dist.destroy_process_group()
        except Exception as exc:  # its own context fails too, as the group is gone
            return type(exc).__name__
        return "no error"
    try:
        _step(rank, da, "recv")
    except da.DistBackwardError as exc:
        return str(exc), exc.rank
    return "no error"


def test_a_rank_that_destroyed_the_group_inside_a_context_is_named_in_it() -> None:
    results, codes = run_ranks(_inside, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    assert out == (
        "Error on rank 1: left in distributed autograd context 2 on process group '0' (it "
        "destroyed the group with destroy_process_group) before that context was closed",
        1,
    ), out
    assert results[1] == ("ok", "DistBackwardUnresponsiveError"), results[1]


def _as_many(rank: int, world: int) -> list[list[float]]:
    from xgrad.torch_backend import dist_autograd as da

    return [_step(rank, da, mode) for mode in ("recv", "send", "backward")]


def test_ranks_that_ran_as_many_contexts_leave_without_an_error() -> None:
    """Every rank posts its leave on the channel of a context none of them opens."""
    results, codes = run_ranks(_as_many, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    assert results[0] == ("ok", [[6.0] * 3, [10.0] * 3, [8.0] * 3]), results[0]
    assert results[1] == ("ok", [[], [], []]), results[1]
