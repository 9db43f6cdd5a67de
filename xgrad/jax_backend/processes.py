"""Several JAX processes on one machine: ``jax.distributed`` over gloo, for tests and the crosscheck.

JAX has no spawn of its own: a multi-host job starts one process per host (a cluster
launcher, or by hand) and each calls ``jax.distributed.initialize``. :func:`run_processes`
does that on 127.0.0.1 so the multi-host code path runs on one machine: it starts
``num_processes`` Python processes, each with ``devices_per_process`` CPU devices and CPU
collectives over gloo, connects them through a coordinator on a free port, runs
``target(process_id, num_processes, *args)`` in each, and returns every process's result.

Every wait is bounded: the whole run by ``timeout`` (then every process is killed), the
coordinator's connection and heartbeats by JAX's own timeouts derived from it. A process
that raises or dies is named in the error, with the end of its output.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ProcessError", "initialize", "run_processes"]


class ProcessError(RuntimeError):
    """A JAX process failed, died or timed out; ``process_id`` names it (the first still
    running, at a timeout)."""

    def __init__(self, process_id: int, message: str) -> None:
        super().__init__(message)
        self.process_id = process_id


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def initialize(
    coordinator: str, num_processes: int, process_id: int, timeout: float = 60.0
) -> None:
    """``jax.distributed.initialize`` with CPU collectives over gloo and bounded waits.

    Call first thing in each process, before anything else touches JAX's devices.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seconds = max(int(timeout), 1)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=max(seconds // 2, 10),
        shutdown_timeout_seconds=seconds,
    )


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"target={target!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def run_processes(
    target: str,
    num_processes: int,
    args: Sequence[Any] = (),
    *,
    devices_per_process: int = 1,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``target(process_id, num_processes, *args)`` in ``num_processes`` JAX processes.

    Args:
        target: ``"package.module:function"`` (importable in a fresh interpreter).
        num_processes: processes to start (the world is all their devices).
        args: picklable arguments.
        devices_per_process: CPU devices each process gets.
        timeout: seconds for the whole run; nothing waits longer.

    Returns:
        Each process's return value, by process id.

    Raises:
        ValueError: a bad count or timeout.
        ProcessError: a process raised (its traceback is in the message), died, or the
            run timed out (every process is then killed).
    """
    for label, value in (
        ("num_processes", num_processes),
        ("devices_per_process", devices_per_process),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive integer")
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0")
    _resolve(target)  # fail here, not in every child
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    # The children import what this process can (the target's module included).
    paths = [p for p in (*sys.path, *env.get("PYTHONPATH", "").split(os.pathsep)) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    with tempfile.TemporaryDirectory(prefix="xgrad-jax-") as tmp:
        folder = Path(tmp)
        (folder / "job.pkl").write_bytes(
            pickle.dumps((target, num_processes, tuple(args), coordinator, timeout))
        )
        procs = []
        for pid in range(num_processes):
            log = open(folder / f"log{pid}.txt", "wb")  # noqa: SIM115 - closed below
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, "-m", __name__, str(folder), str(pid)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + timeout
        try:
            failed = _wait(procs, deadline)
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        if failed is not None:
            culprit, why = failed
            tail = (folder / f"log{culprit}.txt").read_text(errors="replace")[-3000:]
            raise ProcessError(culprit, f"{why}\n{tail}".rstrip())
        return [
            pickle.loads((folder / f"result{pid}.pkl").read_bytes()) for pid in range(num_processes)
        ]


def _wait(
    procs: list[tuple[subprocess.Popen[bytes], Any]], deadline: float
) -> tuple[int, str] | None:
    """Wait for every process; the first failure (lowest id among those that failed) or None."""
    while True:
        codes = [proc.poll() for proc, _ in procs]
        bad = [pid for pid, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            pid = bad[0]
            return pid, f"JAX process {pid} of {len(procs)} exited with code {codes[pid]}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            waiting = [pid for pid, code in enumerate(codes) if code is None]
            return waiting[0], (
                f"JAX processes {waiting} of {len(procs)} still running at the timeout; "
                "all were killed"
            )
        time.sleep(0.05)


def _child(folder: Path, pid: int) -> None:
    target, num_processes, args, coordinator, timeout = pickle.loads(
        (folder / "job.pkl").read_bytes()
    )
    try:
        initialize(coordinator, num_processes, pid, timeout)
        result = _resolve(target)(pid, num_processes, *args)
        (folder / f"result{pid}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        # Exit at once: JAX's exit handler would wait at the shutdown barrier for peers
        # that may be waiting for this process, and the parent names the failure sooner.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import jax

    jax.distributed.shutdown()


if __name__ == "__main__":
    _child(Path(sys.argv[1]), int(sys.argv[2]))
