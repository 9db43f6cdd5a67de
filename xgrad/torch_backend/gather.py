"""Run a function on several gloo ranks and gather what each survivor reports.

:func:`xgrad.torch_backend.spawn.spawn` stops at the first rank that fails, which is what
a training launch wants. A fault experiment wants the opposite: one rank raises, dies or
freezes on purpose, and what matters is what the *other* ranks report (what they raised,
how fast) and whether they then exit by themselves. :func:`gather_ranks` runs until every
rank it waits for has exited, or a time limit, then kills whatever is left. The fault
bench and the failure tests both launch through it, so they observe ranks the same way.
"""

from __future__ import annotations

import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from xgrad.torch_backend.launch import Packed, context, init_method, pack

#: The status of a rank whose function returned, and of one whose function raised.
OK, ERROR = "ok", "error"


def _child(rank: int, world: int, packed: Packed, init: str, out: Any) -> None:
    fn, args = packed.unpack()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    # Every rank's connections made before ``fn`` runs: gloo's init returns on a rank once
    # its own are, and a rank that dies on purpose at once failed a peer still making its
    # own inside init ("connectFullMesh failed"), before ``fn`` could report anything.
    dist.barrier()
    try:
        # Pickled here, as plain bytes: a tensor put on the queue as it is travels as a
        # shared-memory handle, which the parent failed to open (EOFError,
        # FileNotFoundError) when this rank had exited before the parent read it.
        out.put((rank, OK, pickle.dumps(fn(rank, world, *args))))
    except BaseException as exc:
        out.put((rank, ERROR, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if dist.is_initialized():
        dist.destroy_process_group()


def _drain(out: Any, results: dict[int, tuple[str, Any]], wait: float) -> bool:
    """Move one report from ``out`` into ``results``; False when none came within ``wait``."""
    try:
        rank, status, value = out.get(timeout=wait)
    except queue_module.Empty:
        return False
    results[rank] = (status, pickle.loads(value) if status == OK else value)
    return True


def gather_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    limit: float,
    wait_for: Iterable[int] | None = None,
    env: Mapping[str, str] | None = None,
    store: str | None = None,
) -> tuple[dict[int, tuple[str, Any]], dict[int, int | None]]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks.

    Returns each reporting rank's ``(OK, value)`` or ``(ERROR, "Type: message\\ntrace")``
    and every rank's exit code. The run ends when every rank in ``wait_for`` (default:
    all) has exited, or after ``limit`` seconds; then every process still alive is killed
    and its exit code is None (it had not exited by itself). Ranks that never report
    (killed, frozen) have no result. ``env`` is set in each child before ``fn`` and ``args``
    are unpickled (:mod:`.launch`). ``store``: ``"file"`` or ``"tcp"`` (see
    :func:`~.launch.init_method`).
    """
    packed = pack(fn, args, env)
    ctx = context()
    tmp = tempfile.mkdtemp(prefix="xgrad-ranks-")
    out = ctx.Queue()
    init = init_method(tmp, store)
    child_args = (packed, init, out)
    procs = [
        ctx.Process(target=_child, args=(r, world, *child_args), daemon=True) for r in range(world)
    ]
    awaited = [procs[r] for r in (range(world) if wait_for is None else wait_for)]
    results: dict[int, tuple[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            # Once every rank has reported (each reports at most once), nothing more can
            # come: only the exits are awaited, and looked for every 10 ms.
            every = len(results) == world
            got = _drain(out, results, 0.01 if every else 0.1)
            exited = all(p.exitcode is not None for p in awaited)
            if exited and (not got or len(results) == world):
                break
        while len(results) < world and _drain(out, results, 0.2):
            pass  # reports sent just before their rank exited
        codes = {r: p.exitcode for r, p in enumerate(procs)}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        out.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return results, codes
