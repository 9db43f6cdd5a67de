"""The DDP's waits that poll before they block: the setting, the poll, and failures with it on.

The setting and the poll are checked in process. One run of two gloo ranks with the spin
forced on (``XGRAD_DDP_SPIN``) checks that it changes nothing but time: gradients equal
bit for bit to a DDP that blocks at once, a peer's failure named within the bound, a
slow peer (the spin runs out, the blocking wait takes over) still reduced, and a killed
peer named and the survivor able to exit.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from typing import Any

import pytest
from ranks import run_ranks

from xgrad.torch_backend import ddp_spin
from xgrad.torch_backend.ddp_spin import DEFAULT_SPIN_S, SPIN_ENV, resolve_spin, spin_until

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 6.0  # the DDP's timeout= in the run below
SPIN = 0.01


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


def test_the_spin_is_on_by_default_only_where_each_rank_can_have_a_cpu(
    env: pytest.MonkeyPatch,
) -> None:
    env.setattr(ddp_spin, "_usable_cpus", lambda: 2)
    assert resolve_spin(2, poll=0.02) == DEFAULT_SPIN_S
    assert resolve_spin(3, poll=0.02) == 0.0
    assert resolve_spin(2, poll=0.004) == 0.004  # never longer than the channel's poll
    env.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun's: ranks on this machine, not all
    assert resolve_spin(8, poll=0.02) == DEFAULT_SPIN_S
    env.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_spin(2, poll=0.02) == 0.0


def test_no_spin_on_cuda_where_polling_a_collective_waits_for_the_gpu(
    env: pytest.MonkeyPatch,
) -> None:
    env.setattr(ddp_spin, "_usable_cpus", lambda: 16)
    assert resolve_spin(1, poll=0.02, device="cpu") == DEFAULT_SPIN_S
    assert resolve_spin(1, poll=0.02, device="cuda") == 0.0
    env.setenv(SPIN_ENV, "0.003")  # asked for explicitly: the user's choice
    assert resolve_spin(1, poll=0.02, device="cuda") == 0.003


def test_the_environment_sets_the_spin_and_bad_values_are_named(env: pytest.MonkeyPatch) -> None:
    env.setattr(ddp_spin, "_usable_cpus", lambda: 1)
    env.setenv(SPIN_ENV, "0.003")
    assert resolve_spin(64, poll=0.02) == 0.003
    env.setenv(SPIN_ENV, "0")
    assert resolve_spin(1, poll=0.02) == 0.0
    for bad in ("fast", "-1", "inf", "nan"):
        env.setenv(SPIN_ENV, bad)
        with pytest.raises(ValueError, match=f"{SPIN_ENV}='{bad}'"):
            resolve_spin(2, poll=0.02)
    env.delenv(SPIN_ENV)
    env.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two'"):
        resolve_spin(2, poll=0.02)


def test_spin_until_sees_a_completion_from_another_thread_and_stops_at_its_bound() -> None:
    done = threading.Event()
    threading.Timer(0.002, done.set).start()
    assert spin_until(done.is_set, 5.0)  # returns when set (a Python thread: the GIL is yielded)
    start = time.perf_counter()
    assert not spin_until(lambda: False, 0.02)
    elapsed = time.perf_counter() - start
    assert 0.02 <= elapsed < 2.0, elapsed


def _spinning(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(FAST)
    os.environ[SPIN_ENV] = str(SPIN)
    import torch
    import torch.distributed as dist
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    blocking = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 2, generator=g)
    xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
    step = [0]

    def fault(grad: Any) -> Any:
        if rank == 1 and step[0] == 1:
            raise RuntimeError("boom in backward on rank 1")
        if rank == 1 and step[0] == 2:
            time.sleep(0.3)  # the peer's spin runs out: its blocking wait takes over
        return grad

    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    ref = DistributedDataParallel(blocking, timeout=TIMEOUT)
    ref._watch.spin = 0.0
    model[2].weight.register_hook(fault)
    out: dict[str, Any] = {"spin": ddp._watch.spin, "ref_spin": ref._watch.spin}
    for s in range(3):
        step[0] = s
        # Not the blocking DDP at the failed step: the failing rank posts its failure at
        # its next forward pass of the DDP that failed, which the peer is waiting for.
        for m, d in ((model, ddp), (blocking, ref))[: 1 if s == 1 else 2]:
            m.zero_grad()
            start = time.monotonic()
            try:
                ((d(xs) - ys) ** 2).mean().backward()
            except Exception as exc:
                if d is ddp:
                    out[f"error{s}"] = f"{type(exc).__name__}: {exc}"
                    out[f"origin{s}"] = getattr(exc, "rank", None)
            if d is ddp:
                out[f"seconds{s}"] = time.monotonic() - start
        if s != 1:
            out[f"equal{s}"] = all(
                torch.equal(p.grad, q.grad)
                for p, q in zip(model.parameters(), blocking.parameters(), strict=True)
            )
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        ((ddp(xs) - ys) ** 2).mean().backward()
    except Exception as exc:
        out["killed_error"] = f"{type(exc).__name__}: {exc}"
        out["killed_origin"] = getattr(exc, "rank", None)
    out["killed_seconds"] = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    out["destroy_seconds"] = time.monotonic() - start
    return out


def test_with_the_spin_on_results_and_failures_are_as_without() -> None:
    results, codes = run_ranks(_spinning, 2, timeout=90)
    status, out = results[0]
    assert status == "ok", out
    assert (out["spin"], out["ref_spin"]) == (SPIN, 0.0)
    assert out["equal0"] and out["equal2"], out  # bit for bit, incl. after a failed step
    assert "rank 1 in backward" in out["error1"], out
    assert out["origin1"] == 1, out
    assert out["seconds1"] < 2.0 + 3.0, out  # the heartbeat's 2 s, room for a loaded machine
    assert "error2" not in out, out  # a slow peer is waited for, not failed
    assert out["seconds2"] >= 0.3, out
    assert "rank 1" in out["killed_error"] and out["killed_origin"] == 1, out
    assert out["killed_seconds"] < TIMEOUT + 4.0, out
    assert out["destroy_seconds"] < TIMEOUT + 4.0, out
    assert codes[0] == 0
