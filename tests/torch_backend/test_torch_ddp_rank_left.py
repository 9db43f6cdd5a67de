"""A rank leaves a DDP's group with nothing unfinished while its peers go on.

Three gloo ranks train a ``Linear``; rank 1 stops early and leaves: after fewer
iterations than its peers (inputs of different lengths, without ``join()``), or in the
middle of an iteration (after its ``no_sync`` pass, or after a forward pass whose
backward it never runs). It destroys the group (the launcher does), its DDP still
held, or its process just ends, its DDP collected as the loop's function returned. Its
peers waited in their next collective until its connections closed, and named
it as one that "stopped answering" (gloo's "Connection closed" in the text). Now it posts,
as it leaves, a note in the step its peers wait for it in
(:mod:`xgrad.torch_backend.ddp_exit`), and they raise ``RankUnresponsiveError`` saying
which rank left, when, and how, at once; a peer left so (or by a synchronised backward
pass that raised) then exits cleanly, where its collective left pending made gloo abort
it at exit ("terminate called after throwing an instance of 'gloo::IoException'"),
whether it destroyed the group or not. Also checked: when every rank ran as many
iterations, the notes of the ranks that left first fail no one (a rank evaluating alone
under ``torch.no_grad()`` after they left, then a last iteration on the others' group),
and a rank whose step raised a peer's leave still evaluates alone under
``torch.no_grad()`` (a pass that communicates nothing), raising it again at its next step.
"""

from __future__ import annotations

import functools
import textwrap
import time
from typing import Any

import pytest
from ranks import every_rank_ok, run_plain, run_ranks

WORLD = 3
TIMEOUT = 3.0
PEER_STEPS = 4

#: the DDPs a rank keeps until its group is destroyed (the launcher's destroy, after the
#: function returned).
_HELD: list[Any] = []


def _run(rank: int, world: int, leave: str, how: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    if how == "ends" and rank == 1:  # the launcher's destroy skipped: the process ends
        dist.destroy_process_group = lambda *args, **kwargs: None
    else:
        _HELD.append(ddp)
    g = torch.Generator().manual_seed(rank)
    error, started, done = "", 0.0, 0
    for step in range(PEER_STEPS):
        started = time.monotonic()
        if rank == 1 and step == 2:
            if leave == "no_sync":
                with ddp.no_sync():
                    ddp(torch.randn(3, 4, generator=g)).sum().backward()
            elif leave == "forward":
                ddp(torch.randn(3, 4, generator=g))
            break  # leaves (after 2 iterations, or inside the third)
        try:
            ddp.zero_grad()
            ddp(torch.randn(3, 4, generator=g)).sum().backward()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
        done += 1
    return {"error": error, "waited": time.monotonic() - started, "done": done}


@pytest.mark.parametrize("how", ["destroyed", "ends"])
@pytest.mark.parametrize("leave", ["after", "no_sync", "forward"])
def test_the_peers_name_the_rank_that_left(leave: str, how: str) -> None:
    results, codes = run_ranks(functools.partial(_run, leave=leave, how=how), WORLD, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert results[1][0] == "ok" and results[1][1]["done"] == 2, results[1]
    said = (
        "it destroyed the group with destroy_process_group"
        if how == "destroyed"
        else "its process ended"
    )
    if leave == "after":
        expected = (
            f"RankUnresponsiveError: rank 1: left after 2 iterations of the DDP ({said}): "
            "it never runs iteration 3, in which the other ranks wait for it"
        )
    else:
        expected = (
            f"RankUnresponsiveError: rank 1: left in iteration 3 of the DDP ({said}), before "
            "its synchronised backward pass, in which the other ranks wait for it"
        )
    for peer in (0, 2):
        status, value = results[peer]
        assert status == "ok", (peer, value)
        assert value["error"].startswith(expected), (peer, value)
        assert value["waited"] < TIMEOUT, (peer, value)  # at once, not at the timeout
        assert value["done"] == 2, (peer, value)


def _even(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2), timeout=TIMEOUT)
    for _ in range(2):
        ddp(torch.ones(3, 4)).sum().backward()
    if rank == 2:
        return {}  # leaves first (its DDP collected; the launcher destroys the group)
    sub = dist.new_group([0, 1])
    dist.barrier(group=sub)  # rank 2 has left
    time.sleep(0.5)
    with torch.no_grad():  # rank 0 evaluates alone: no collective, no note read
        shape = list(ddp(torch.ones(1, 4)).shape) if rank == 0 else []
    other = DistributedDataParallel(nn.Linear(4, 2), process_group=sub, timeout=TIMEOUT)
    other(torch.ones(3, 4)).sum().backward()  # another DDP trains on as before
    return {"shape": shape, "grad": other.module.weight.grad.sum().item()}


def test_ranks_that_ran_as_many_iterations_fail_no_one() -> None:
    results, codes = run_ranks(_even, WORLD, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert results[0] == ("ok", {"shape": [1, 2], "grad": 24.0}), results[0]
    assert results[1] == ("ok", {"shape": [], "grad": 24.0}), results[1]


def _alone(rank: int, world: int, buffers: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    layers = [nn.Linear(4, 2)] + ([nn.BatchNorm1d(2)] if buffers else [])
    ddp = DistributedDataParallel(nn.Sequential(*layers), timeout=TIMEOUT)
    ddp(torch.ones(3, 4)).sum().backward()
    if rank == 1:
        return {}  # leaves after one iteration
    said = []
    for grad in (True, False, True):  # its step; an evaluation alone; a step again
        ddp.train(grad)
        try:
            with torch.set_grad_enabled(grad):
                out = ddp(torch.ones(2, 4))
            if grad:
                out.sum().backward()
            said.append(list(out.shape))
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {str(exc)[:31]}")
    return {"said": said}


@pytest.mark.parametrize("buffers", [False, True])
def test_a_rank_whose_peer_left_evaluates_alone(buffers: bool) -> None:
    """After its step raised the peer's leave, a rank evaluates under ``torch.no_grad()``
    alone (no collective: PyTorch's runs it too); its next step raises the peer's error
    again (a rank still gone: its error, not a hang), and so does an evaluation that
    broadcasts buffers (BatchNorm's, after a training pass), as PyTorch's would fail."""
    results, codes = run_ranks(_alone, 2, (buffers,), timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    gone = "RankUnresponsiveError: rank 1: left after 1 iterations"
    evaluated = gone if buffers else [2, 2]
    assert results[0] == ("ok", {"said": [gone, evaluated, gone]}), results[0]


_MAIN = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    rank, init, how, timeout, end = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    from xgrad.torch_backend import DistributedDataParallel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    def between(module, inputs, output):
        def boom(grad):
            if rank == 1 and step == 2:
                raise ValueError("boom")
            return grad
        output.register_hook(boom)
    if how == "raised":
        model[1].register_forward_hook(between)
    ddp = DistributedDataParallel(model, timeout=timeout)
    for step in range(2 if rank == 1 and how == "after" else 4):
        started = time.monotonic()
        try:
            ddp(torch.ones(3, 4)).sum().backward()
        except ValueError:
            raise  # rank 1's own: its process ends with it
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}".splitlines()[0], time.monotonic() - started)
            break
    if end == "destroyed":
        dist.destroy_process_group()  # (else the process ends as a plain script's does)
    """
)


@pytest.mark.parametrize(
    ("how", "end"), [("after", "ends"), ("raised", "ends"), ("raised", "destroyed")]
)
def test_a_peer_exits_cleanly(how: str, end: str, tmp_path: Any) -> None:
    outs = run_plain(_MAIN, 2, f"file://{tmp_path}/store", [how, str(TIMEOUT), end])
    code, out, err = outs[0]
    assert code == 0, (code, err[-3000:])  # not gloo's abort at exit (-6)
    said, waited = out.strip().rsplit(" ", 1)
    if how == "after":
        assert said.startswith(
            "RankUnresponsiveError: rank 1: left after 2 iterations of the DDP (its process ended)"
        ), out
    else:
        assert said == "RankError: rank 1 in backward: ValueError: boom", out
        assert outs[1][0] == 1 and "ValueError: boom" in outs[1][2], outs[1]
    assert float(waited) < TIMEOUT, out


def _many(rank: int, world: int) -> list[int]:
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel, ddp_exit

    def trained_and_dropped(group: Any, count: int) -> int:
        for _ in range(count):
            ddp = DistributedDataParallel(nn.Linear(4, 2), process_group=group, timeout=TIMEOUT)
            ddp(torch.ones(3, 4)).sum().backward()
            del ddp
            gc.collect()
        return len(ddp_exit.GONE)

    sub = dist.new_group([0, 1])
    counts = [trained_and_dropped(None, 12), trained_and_dropped(sub, 12)]
    dist.destroy_process_group(sub)
    counts.append(trained_and_dropped(None, 1))
    return counts


def test_the_notes_of_dropped_ddps_stay_few() -> None:
    """A loop that makes and drops DDPs (trials, retries) keeps the leave notes of the
    last eight of each group (each a store write at exit), and none of a destroyed one."""
    results = every_rank_ok(_many, 2, timeout=120)
    assert results == {0: [8, 16, 8], 1: [8, 16, 8]}, results
