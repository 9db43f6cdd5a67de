"""The local launcher: results by rank, a real collective, failures and timeouts named."""

from __future__ import annotations

import time

import pytest

from xgrad.torch_backend.spawn import SpawnError, spawn


def _sum_ranks(rank: int, world_size: int, scale: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank * scale, float(t.item())


def _fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    time.sleep(60)
    return rank


def _sleep_on_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def _collector(rank: int, world_size: int) -> tuple[int, int]:
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_a_ranks_collections_skip_what_it_started_with() -> None:
    """What a rank holds from its start (the fork server's torch imports, some 300,000
    objects) is frozen: a full collection, which a rank makes at each DDP built after a
    dropped one, walked all of it (0.2-0.4 s each on a small machine)."""
    for frozen, tracked in spawn(_collector, 2):
        assert frozen > 10 * tracked, (frozen, tracked)


_IMPORT_WATCH = """
import json, os, sys, threading
read = []
cls = type(os.environ)
get, has, each = cls.__getitem__, cls.__contains__, cls.__iter__


def reader():  # the module that asked, past this watch, os and the mapping's methods
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") in ("__main__", "os", "collections.abc"):
        frame = frame.f_back
    return str(frame.f_globals.get("__name__"))


def note(key):
    if reader().startswith("xgrad"):
        read.append(key)


cls.__getitem__ = lambda self, key: (note(key), get(self, key))[1]
cls.__contains__ = lambda self, key: (note(key), has(self, key))[1]
cls.__iter__ = lambda self: (note("*"), each(self))[1]
for name in sys.argv[1].split(","):
    __import__(name)
print(json.dumps([read, threading.active_count()]))
"""


def test_the_xgrad_modules_every_rank_inherits_read_no_environment_at_import() -> None:
    """The fork server imports xgrad's launcher modules once, with the environment it
    started with (``launch.LAUNCHER_MODULES``): one that read a variable at import would
    see that one in every rank, not the launching process's of the moment. Nor may they
    start a thread: the server forks. (Reads by the modules they import from elsewhere,
    NumPy's, are the server's either way: torch, imported there first, imports those.)"""
    import json
    import subprocess
    import sys

    from xgrad.torch_backend import launch

    assert set(launch.LAUNCHER_MODULES) <= set(launch.PRELOAD)
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_WATCH, ",".join(launch.LAUNCHER_MODULES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[], 1]


def test_results_by_rank_after_a_real_allreduce() -> None:
    assert spawn(_sum_ranks, 3, args=(10,)) == [(0, 3.0), (10, 3.0), (20, 3.0)]


def test_first_failure_names_rank_and_traceback_and_stops_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError, match="rank 1 failed: ValueError: boom on purpose") as info:
        spawn(_fail_on_one, 2, timeout=50)
    assert info.value.rank == 1
    assert "_fail_on_one" in info.value.remote_traceback
    assert time.monotonic() - start < 40


def test_timeout_names_ranks_still_running() -> None:
    with pytest.raises(SpawnError, match=r"ranks still running: \[0\]"):
        spawn(_sleep_on_zero, 2, timeout=6)


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        spawn(_sum_ranks, 0)


def test_nccl_with_more_ranks_than_gpus_is_refused_before_any_rank_starts() -> None:
    import torch

    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"world_size={gpus + 1} is more than the {gpus} CUDA"):
        spawn(_sum_ranks, gpus + 1, args=(1,), backend="nccl")


def _killed_peer(rank: int, world_size: int) -> int:
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # the survivors see a closed connection, and report first
    return rank


def _names_its_origin(rank: int, world_size: int) -> int:
    if rank == 0:

        class Named(RuntimeError):
            rank = 1

        raise Named("rank 1 in comm hook, bucket 0: the peer's error")
    time.sleep(60)  # rank 1, the origin, stays alive
    return rank


def test_a_killed_rank_is_blamed_not_the_survivor_that_reported_first() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_killed_peer, 3, timeout=60)
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 was killed by SIGKILL without returning a result")
    assert "rank 0 then failed" in message and "rank 2 then failed" in message


def test_an_error_naming_its_origin_blames_that_rank() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_names_its_origin, 2, timeout=30)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 failed (reported by rank 0): Named: rank 1 in")


def test_each_launch_gives_its_ranks_the_environment_as_it_is_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks are forked from a server started at the first launch (``launch.py``); each
    launch still hands them the launching process's environment of that moment, before
    their function's module is imported."""
    from launched import seen

    monkeypatch.setenv("XGRAD_LAUNCH_TEST", "first")
    monkeypatch.setenv("XGRAD_LAUNCH_GONE", "here")
    assert spawn(seen, 2) == [("first", "first", "here")] * 2
    monkeypatch.setenv("XGRAD_LAUNCH_TEST", "second")
    monkeypatch.delenv("XGRAD_LAUNCH_GONE")
    assert spawn(seen, 2) == [("second", "second", None)] * 2


def test_the_start_method_can_be_spawn_and_nothing_else_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from launched import seen

    monkeypatch.setenv("XGRAD_LAUNCH_TEST", "spawned")
    monkeypatch.setenv("XGRAD_START_METHOD", "spawn")
    assert spawn(seen, 2) == [("spawned", "spawned", None)] * 2
    monkeypatch.setenv("XGRAD_START_METHOD", "fork")
    with pytest.raises(ValueError, match="XGRAD_START_METHOD='fork'"):
        spawn(seen, 2)
