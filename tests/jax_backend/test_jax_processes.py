"""Several JAX processes (jax.distributed over gloo on 127.0.0.1): gradients equal one process."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from xgrad import models  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad  # noqa: E402
from xgrad.jax_backend.processes import ProcessError, run_processes  # noqa: E402
from xgrad.jax_backend.reduce import plan_for  # noqa: E402
from xgrad.powersgd import PowerSGD  # noqa: E402

BATCH = 16
HOOK = PowerSGD(start_powerSGD_iter=2)


def _host(a: Any) -> np.ndarray:
    return np.asarray(a if a.is_fully_addressable else a.addressable_data(0))


def runs(
    process_id: int, num_processes: int, full: bool = True, world: int | None = None
) -> dict[str, Any]:
    """Every way of passing the batch, every mode, and three stateful PowerSGD steps.

    Run in each process over every process's devices, and in the test process on the
    first ``world`` of its own devices (one process: the local rows are all the rows)."""
    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, BATCH, "float32")
    devices = jax.devices() if world is None else jax.devices()[:world]
    world = len(devices)
    plan = plan_for(w, names=list(w), bucket_cap_bytes=2048)
    loss = jm.make_loss(jm.mlp)
    params = jm.to_params(w)
    mine = models.shard(x, num_processes, process_id), models.shard(y, num_processes, process_id)
    out: dict[str, Any] = {"world": world, "processes": jax.process_count()}
    for local in (False, True):
        for mode in ("shard_map", "jit") if full else ("shard_map",):
            if mode == "jit" and local:
                continue
            step = data_parallel_value_and_grad(
                loss,
                world_size=world,
                names=list(w),
                plan=None if mode == "jit" else plan,
                mode=mode,
                local_batch=local,
                devices=devices,
            )
            _, grads = step(params, *(mine if local else (x, y)))
            out[f"{mode}-{'local' if local else 'global'}"] = {
                k: _host(g) for k, g in grads.items()
            }

    # What NumPy gives by default (float64, JAX in 32-bit mode), an RNG key and a Python
    # float given whole: JAX's own device_put refused each across processes.
    def noisy(params: Any, x: Any, y: Any, key: Any, scale: float) -> Any:
        return loss(params, x + scale * jax.random.normal(key, x.shape[1:]), y)

    step = data_parallel_value_and_grad(
        noisy, world_size=world, in_axes=(0, 0, None, None), devices=devices
    )
    host = x.astype(np.float64), y.astype(np.float64), jax.random.key(0), 0.1
    out["host-values"] = {k: _host(g) for k, g in step(params, *host)[1].items()}
    if not full:
        return out
    step = data_parallel_value_and_grad(
        loss,
        world_size=world,
        names=list(w),
        plan=plan,
        hook=HOOK,
        local_batch=True,
        devices=devices,
    )
    state = step.init(params)
    for _ in range(3):
        _, grads, state = step(params, *mine, hook_state=state)
    out["powersgd"] = {k: _host(g) for k, g in grads.items()}
    # A global batch the devices do not divide (13 rows: 7 and 6 at two devices), every
    # process passing it whole: split as torch's tensor_split, across the processes too.
    step = data_parallel_value_and_grad(
        loss, world_size=world, names=list(w), plan=plan, devices=devices
    )
    out["shard_map-uneven"] = {k: _host(g) for k, g in step(params, x[:13], y[:13])[1].items()}
    if num_processes > 1:
        # Processes passing different numbers of rows (6 and 10 of 16 at two processes):
        # a ValueError on every process, where it used to return wrong gradients.
        cut = BATCH // num_processes - 2 * (process_id == 0) + 2 * (process_id == 1)
        lo = sum(BATCH // num_processes - 2 * (q == 0) + 2 * (q == 1) for q in range(process_id))
        step = data_parallel_value_and_grad(loss, world_size=world, local_batch=True)
        try:
            step(params, x[lo : lo + cut], y[lo : lo + cut])
            out["uneven"] = "no error"
        except ValueError as exc:
            out["uneven"] = str(exc)
        # Process 0's devices only, each process passing its rows: process 1's rows had
        # nowhere to go (process 0 returned the gradient of its own rows alone).
        step = data_parallel_value_and_grad(
            loss, world_size=world // num_processes, local_batch=True
        )
        try:
            step(params, *mine)
            out["devices"] = "no error"
        except ValueError as exc:
            out["devices"] = str(exc)
    return out


def fail_in_process_1(process_id: int, num_processes: int) -> int:
    if process_id == 1:
        raise RuntimeError("boom in process 1")
    time.sleep(30)  # process 0 would wait for its peer: the run must not
    return process_id


def _check(results: list[dict[str, Any]], single: dict[str, Any], n: int) -> None:
    assert [r["processes"] for r in results] == [n] * n
    assert results[0]["world"] == n
    for result in results:
        if n == 2:
            assert result.pop("uneven") == (
                "batch argument 0 has 6 rows on process 0, 10 rows on process 1: with "
                "local_batch=True every process passes the same number of rows (its share of "
                "the global batch)"
            )
            assert result.pop("devices").startswith(
                "local_batch=True splits each process's rows over its own devices of the step, "
                "so every process needs as many of them; the step's 1 devices are 1 on process "
                "0, 0 on process 1"
            )
        for key, grads in result.items():
            if key in ("world", "processes"):
                continue
            for name, g in grads.items():
                # gloo may sum in another order than one process's devices do: equal to
                # float32 rounding (2 processes give the same bits here, 4 do not).
                scale = np.abs(single[key][name]).max()
                assert np.abs(g - single[key][name]).max() <= 1e-6 * scale, (key, name)


def test_two_processes_give_the_single_process_gradients() -> None:
    """Global batch and each process's own rows, shard_map and jit, stateful PowerSGD."""
    results = run_processes("test_jax_processes:runs", 2, timeout=90)
    _check(results, runs(0, 1, world=2), 2)


@pytest.mark.slow
def test_four_processes_give_the_single_process_gradients() -> None:
    results = run_processes("test_jax_processes:runs", 4, (False,), timeout=120)
    _check(results, runs(0, 1, False, world=4), 4)


def test_a_failing_process_is_named_and_the_others_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(ProcessError, match="JAX process 1 of 2 exited") as info:
        run_processes("test_jax_processes:fail_in_process_1", 2, timeout=60)
    assert info.value.process_id == 1
    assert "boom in process 1" in str(info.value)
    assert time.monotonic() - start < 30


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_processes=0"):
        run_processes("test_jax_processes:runs", 0)
    with pytest.raises(ValueError, match="timeout=nan"):
        run_processes("test_jax_processes:runs", 2, timeout=float("nan"))
    with pytest.raises(ValueError, match="target='runs'"):
        run_processes("runs", 2)


def hang(process_id: int, num_processes: int) -> None:
    time.sleep(120)


def test_a_hanging_run_is_stopped_at_its_timeout() -> None:
    # 3 s, not less: the processes' own connection timeout is its whole seconds, and must
    # not end the run (a process failing to connect) before the run's timeout does.
    start = time.monotonic()
    with pytest.raises(ProcessError, match=r"still running at the timeout; all were killed"):
        run_processes("test_jax_processes:hang", 2, timeout=3)
    assert time.monotonic() - start < 12  # four times the timeout


@pytest.mark.slow
def test_crosscheck_runs_the_jax_rows_in_two_processes(tmp_path: Any) -> None:
    """``xgrad crosscheck --jax-processes 2``: stateful PowerSGD, same plan and data as torch."""
    pytest.importorskip("torch")
    from xgrad import crosscheck

    case = crosscheck.Case(hook="powersgd", stateful=True, steps=3, jax_processes=2)
    report = crosscheck.run_crosscheck(case, backends=["torch-xgrad", "jax-shard_map", "jax-pmap"])
    status = {b.name: b.status for b in report.backends}
    assert status == {"torch-xgrad": "ok", "jax-shard_map": "ok", "jax-pmap": "skipped"}
    with pytest.raises(ValueError, match="jax_processes=3 does not divide world_size=2"):
        crosscheck.Case(jax_processes=3)
