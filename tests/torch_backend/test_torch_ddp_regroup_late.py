"""A peer late for the DDP's new group after a failed step: named soon, and met again.

Gloo ranks, DDP timeout 2 s, the default 10 s heartbeat timeout. Rank 1 raises in its
forward pass at the second step; the others go on to the third at once, while rank 1
sleeps (alive: its heartbeat goes on). Their new private group runs out its timeout
(c10d's "Wait timeout"). That failure was read as a connection lost at once: the
heartbeats were watched for 1.5 heartbeat timeouts, and the step raised about 18 s after
it began, naming the rank that gave up (in a pipeline under ``dp_group``, each rank of a
late replica waited so in turn). Now the ranks making a group say they wait for every
rank, and the one that waits for nobody is named at once: rank 1, not a rank that waited
in the group too.

When rank 1 then comes, its peers gave that group up: it raises their failure at once
instead of making the group (it read the address a peer had left and spent gloo's 10 s
connect timeout on it, while the peer made its next group; each then making the group
the other had given up, the two never met again), and the next step pairs up.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from ranks import armed_linear, run_ranks

TIMEOUT = 2.0


def _steps(rank: int, world: int, comes_back: bool, members: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group(members) if len(members) < world else None
    if rank not in members:
        return {}
    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT, process_group=group)
    out: dict[str, Any] = {}
    for i in range(5 if comes_back else 3):
        if rank == 1 and i == 2:  # late for the new group: asleep until a peer reported
            deadline = time.monotonic() + 40.0
            while not store.check(["late/reported"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not comes_back:
                return out
        armed[0] = rank == 1 and i == 1
        start = time.monotonic()
        try:
            ddp(torch.randn(3, 4)).pow(2).mean().backward()
            out[f"step{i}"] = ("ok", None, time.monotonic() - start)
        except Exception as exc:
            out[f"step{i}"] = (f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None),
                               time.monotonic() - start)  # fmt: skip
        if i == 2 and rank != 1:
            store.set("late/reported", b"1")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_peer_late_for_the_new_group_is_named_soon_by_every_rank_waiting(world: int) -> None:
    results, codes = run_ranks(_steps, world, (False, list(range(world))), timeout=60)
    assert set(codes.values()) == {0}, (codes, results)
    for rank in (0, 2)[: world - 1]:
        status, out = results[rank]
        assert status == "ok", out
        assert out["step1"][0].startswith("RankError: rank 1 in forward: ValueError: boom"), out
        text, origin, seconds = out["step2"]
        # Not rank 2 (with three ranks): it waited in the group too.
        assert origin == 1, (rank, out)
        assert text.startswith("RankUnresponsiveError: rank 1: did not answer within the"), out
        assert "the DDP's new process group" in text, out
        # The group's 2 s wait (gloo's takes about a second more) and room for a loaded
        # machine; not 1.5 heartbeat timeouts (15 s) after it.
        assert seconds < TIMEOUT + 1.0 + 4.0, (rank, out)


@pytest.mark.parametrize("world, members", [(2, [0, 1]), (3, [1, 2])])
def test_a_peer_late_for_the_new_group_raises_at_once_and_the_next_step_pairs_up(
    world: int, members: list[int]
) -> None:
    # Groups of every rank are counted by PyTorch, those of some by xgrad, after their
    # group (:mod:`.private_groups`): the late rank counts the group it passes on either.
    # In a DDP of ranks 1 and 2, the late rank's connect to the address its peer left took
    # gloo's 10 s (with every rank: its connection was refused at once).
    results, codes = run_ranks(_steps, world, (True, members), timeout=90)
    assert set(codes.values()) == {0}, (codes, results)
    outs = {rank: results[rank][1] for rank in members}
    assert all(results[rank][0] == "ok" for rank in members), results
    text, origin, seconds = outs[1]["step2"]
    assert origin == 1 and "did not answer within the timeout" in text, outs
    assert seconds < 1.0, outs  # the posted failure, read before making the group
    for rank, out in outs.items():
        assert out["step3"][0] == "ok" and out["step4"][0] == "ok", (rank, outs)
