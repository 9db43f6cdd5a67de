"""A single-machine launcher: one process per rank, a real process group, results back."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["SpawnError", "spawn"]

#: seconds a terminated process gets to exit before it is killed.
_GRACE = 3.0


class SpawnError(RuntimeError):
    """A rank failed (or the run timed out); ``rank`` is the first failing rank (``-1`` on timeout)."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    init_method: str,
    backend: str,
    timeout: float,
    num_threads: int | None,
    results: Any,
) -> None:
    """Runs in the child: join the group, run ``fn``, send ``(rank, ok, payload)`` back."""
    import torch
    import torch.distributed as dist

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        # Pickled here, so an unpicklable result is reported as this rank's failure.
        value = pickle.dumps(fn(rank, world_size, *args))
    except BaseException as exc:  # the parent re-raises it, naming this rank
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    results.put((rank, True, value, ""))
    # Drain before leaving: a hook's future completes while gloo's thread is still
    # unwinding its callbacks (PowerSGD's hold the group); destroying the group in that
    # window drops its last reference on that thread, which then joins itself and aborts.
    dist.barrier()
    dist.destroy_process_group()


def _stop(processes: Sequence[Any]) -> None:
    """Terminate every live process, then kill those that ignore it."""
    processes = [p for p in processes if p.pid is not None]  # some may never have started
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(_GRACE)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout: float = 120.0,
    num_threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes sharing a group.

    Each process joins a ``torch.distributed`` process group (``backend``, rendezvous
    through a file store in a private temporary directory, so no port can be taken by
    someone else) before ``fn`` runs, and leaves it afterwards. ``fn`` and ``args`` must be
    picklable (a module-level function), as must what ``fn`` returns.

    Args:
        fn: the per-rank function.
        world_size: number of processes (ranks ``0 .. world_size - 1``).
        args: extra positional arguments for ``fn``.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA; rank r uses device r).
        timeout: seconds for the whole run, also the process group's collective timeout;
            nothing waits longer.
        num_threads: intra-op threads per process (``None``: torch's default). One keeps
            several ranks on a small machine from oversubscribing its cores.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        SpawnError: the first rank to fail (its message and remote traceback in the
            message), a rank that died without a result, or ranks still running at
            ``timeout``; every other process is stopped first.

    Example:
        >>> def f(rank, world_size):  # doctest: +SKIP
        ...     return rank * 10
        >>> spawn(f, 2)  # doctest: +SKIP
        [0, 10]
    """
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="xgrad-spawn-")
    init_method = "file://" + os.path.join(tmpdir, "store")
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                fn,
                tuple(args),
                init_method,
                backend,
                timeout,
                num_threads,
                results,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    values: dict[int, Any] = {}
    try:
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in values]
                raise SpawnError(
                    f"spawn timed out after {timeout:g} s; ranks still running: {running}",
                    rank=-1,
                )
            try:
                rank, ok, payload, tb = results.get(timeout=min(0.05, remaining))
            except queue_module.Empty:
                _check_exits(processes, values, results)
                continue
            _record(values, rank, ok, payload, tb)
        # Let every rank leave the group cleanly (bounded by the same deadline).
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        _stop(processes)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return [values[r] for r in range(world_size)]


def _check_exits(processes: Sequence[Any], values: dict[int, Any], results: Any) -> None:
    """Raise for a process that exited without sending a result (crash, ``os._exit``)."""
    for rank, p in enumerate(processes):
        if rank in values or p.exitcode is None:
            continue
        # Its message may still be in the queue's pipe: give it a moment to arrive.
        try:
            r, ok, payload, tb = results.get(timeout=1.0)
        except queue_module.Empty:
            raise SpawnError(
                f"rank {rank} exited with code {p.exitcode} without returning a result",
                rank=rank,
            ) from None
        _record(values, r, ok, payload, tb)
        return


def _record(values: dict[int, Any], rank: int, ok: bool, payload: Any, tb: str) -> None:
    """Keep rank's result, or raise its failure with the remote traceback."""
    if not ok:
        raise SpawnError(
            f"rank {rank} failed: {payload}\n--- traceback of rank {rank} ---\n{tb}",
            rank=rank,
            remote_traceback=tb,
        )
    values[rank] = pickle.loads(payload)
