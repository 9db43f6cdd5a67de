"""A single-machine launcher: one process per rank, a real process group, results back."""

from __future__ import annotations

import pickle
import queue as queue_module
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from xgrad.torch_backend.launch import Packed, context, init_method, pack

__all__ = ["SpawnError", "spawn"]

#: seconds a terminated process gets to exit before it is killed.
_GRACE = 3.0

#: seconds to wait, after the first failure, for the rank that caused it to show up.
_SETTLE = 1.5


class SpawnError(RuntimeError):
    """A rank failed (or the run timed out); ``rank`` is the first failing rank (``-1`` on timeout)."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _worker(
    rank: int,
    world_size: int,
    packed: Packed,
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
        fn, args = packed.unpack()
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        if backend != "nccl":
            # gloo connects the full mesh as the group is made: a rank whose function
            # raised at once, and left, failed a peer still connecting to it ("Gloo
            # connectFullMesh failed"), which then reported that as its own failure
            # (seen once in CI under load). NCCL connects lazily, at its first collective.
            dist.barrier()
        # Pickled here, so an unpicklable result is reported as this rank's failure.
        value = pickle.dumps(fn(rank, world_size, *args))
    except BaseException as exc:  # the parent re-raises it, naming this rank
        origin = getattr(exc, "rank", None)  # an error that names the rank it came from
        if not isinstance(origin, int) or not 0 <= origin < world_size or origin == rank:
            origin = None
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc(), origin))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    results.put((rank, True, value, "", None))
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
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes sharing a group.

    The processes are forked from a server that has torch loaded (:mod:`.launch`), and
    take this process's environment as it is at the call.

    Each process joins a ``torch.distributed`` process group (``backend``, rendezvous
    through a file store in a private temporary directory, so no port can be taken by
    someone else; a TCPStore with ``XGRAD_SPAWN_STORE=tcp``) before ``fn`` runs, and leaves it afterwards. ``fn`` and ``args`` must be
    picklable (a module-level function; checked here), as must what ``fn`` returns.

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
        SpawnError: naming the rank that caused the failure, with its message and remote
            traceback and one line per other rank. A rank that died without a result
            (``SIGKILL``, a crash) is blamed before survivors that failed because of it;
            otherwise a rank that the errors themselves name (an exception with a
            ``rank`` attribute, as the failure channel raises), otherwise the first to
            fail. On a timeout, the ranks still running. Every process is stopped first.

    Example:
        >>> def f(rank, world_size):  # doctest: +SKIP
        ...     return rank * 10
        >>> spawn(f, 2)  # doctest: +SKIP
        [0, 10]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if backend == "nccl":
        import torch  # (its device count reads NVML: no CUDA context here, none to fork)

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            # Two ranks on one GPU would fail later, inside NCCL ("Duplicate GPU detected").
            raise ValueError(
                f"backend='nccl' takes one GPU per rank: world_size={world_size} is more "
                f"than the {gpus} CUDA device(s) here"
            )
    packed = pack(fn, args)
    ctx = context()
    tmpdir = tempfile.mkdtemp(prefix="xgrad-spawn-")
    init = init_method(tmpdir)
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                packed,
                init,
                backend,
                timeout,
                num_threads,
                results,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    outcomes = _Outcomes(world_size)
    try:
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout
        settle_until: float | None = None
        while not outcomes.complete():
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                break
            if now >= deadline:
                if outcomes.failed():
                    break
                running = [r for r in range(world_size) if r not in outcomes.values]
                raise SpawnError(
                    f"spawn timed out after {timeout:g} s; ranks still running: {running}",
                    rank=-1,
                )
            try:
                rank, ok, payload, tb, origin = results.get(timeout=0.05)
                outcomes.record(rank, ok, payload, tb, origin)
            except queue_module.Empty:
                outcomes.note_exits(processes, results)
            if settle_until is None and outcomes.failed():
                # The first report is often a consequence (a peer's closed connection);
                # the rank that caused it may be a moment behind: let it show up.
                settle_until = min(deadline, time.monotonic() + _SETTLE)
        if outcomes.failed():
            outcomes.note_exits(processes, results, wait=False)
            raise outcomes.error()
        # Let every rank leave the group cleanly (bounded by the same deadline).
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        _stop(processes)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return [outcomes.values[r] for r in range(world_size)]


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Outcomes:
    """What each rank has said or done so far, and which failure to blame."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.values: dict[int, Any] = {}
        #: rank -> (message, traceback, the rank its error names as the origin or None)
        self.failures: dict[int, tuple[str, str, int | None]] = {}
        #: rank -> how it died without sending anything
        self.deaths: dict[int, str] = {}
        self.order: list[int] = []

    def complete(self) -> bool:
        return len(self.values) + len(self.failures) + len(self.deaths) >= self.world_size

    def failed(self) -> bool:
        return bool(self.failures or self.deaths)

    def record(self, rank: int, ok: bool, payload: Any, tb: str, origin: int | None) -> None:
        self.deaths.pop(rank, None)  # its message was still in the pipe when it exited
        if ok:
            self.values[rank] = pickle.loads(payload)
            return
        self.failures[rank] = (payload, tb, origin)
        self.order.append(rank)

    def note_exits(self, processes: Sequence[Any], results: Any, wait: bool = True) -> None:
        """Note ranks that exited without sending a result (crash, SIGKILL, ``os._exit``)."""
        for rank, p in enumerate(processes):
            if p.exitcode is None:
                continue
            while not self._known(rank):
                # Its message may still be in the queue's pipe: give it a moment to arrive.
                try:
                    self.record(*results.get(timeout=1.0 if wait else 0.2))
                except queue_module.Empty:
                    self.deaths[rank] = _exit_reason(p.exitcode)
                    self.order.append(rank)

    def _known(self, rank: int) -> bool:
        return rank in self.values or rank in self.failures or rank in self.deaths

    def error(self) -> SpawnError:
        """The failure to blame: a rank that died, else the origin the errors name, else the first.

        A killed rank sends nothing while its peers report what they saw of it (gloo's
        "Connection closed by peer"), so arrival order would blame a survivor.
        """
        others = self._others
        if self.deaths:
            rank = min(self.deaths)
            return SpawnError(
                f"rank {rank} {self.deaths[rank]} without returning a result" + others(rank),
                rank=rank,
            )
        reports = [(r, *self.failures[r]) for r in self.order if r in self.failures]
        named = [(reporter, origin) for reporter, _, _, origin in reports if origin is not None]
        if named and named[0][1] not in self.failures:
            # The origin stays alive without reporting (or is frozen): its peers name it.
            reporter, rank = named[0]
            message, tb, _ = self.failures[reporter]
            return SpawnError(
                f"rank {rank} failed (reported by rank {reporter}): {message}{others(rank)}\n"
                f"--- traceback of rank {reporter} ---\n{tb}",
                rank=rank,
                remote_traceback=tb,
            )
        rank = named[0][1] if named else reports[0][0]
        message, tb, _ = self.failures[rank]
        return SpawnError(
            f"rank {rank} failed: {message}{others(rank)}\n--- traceback of rank {rank} ---\n{tb}",
            rank=rank,
            remote_traceback=tb,
        )

    def _others(self, blamed: int) -> str:
        lines = []
        for rank in range(self.world_size):
            if rank == blamed:
                continue
            if rank in self.failures:
                first = self.failures[rank][0].strip().splitlines()[0][:200]
                lines.append(f"rank {rank} then failed: {first}")
            elif rank in self.deaths:
                lines.append(f"rank {rank} {self.deaths[rank]}")
            elif rank not in self.values:
                lines.append(f"rank {rank} was still running (stopped)")
        return "".join(f"\n  {line}" for line in lines)
