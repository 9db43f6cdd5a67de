"""A test launcher that keeps going when a rank dies or freezes on purpose.

``xgrad.torch_backend.spawn`` stops at the first failing rank; the failure tests need the
survivors' results (what they raised, how fast) and whether they then exit cleanly.
"""

from __future__ import annotations

import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


def _child(
    rank: int, world: int, fn: Callable[..., Any], args: Sequence[Any], init: str, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 90.0,
    frozen: Sequence[int] = (),
) -> tuple[dict[int, tuple[str, Any]], dict[int, int | None]]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; results and exit codes by rank.

    Ranks that return nothing (killed, frozen) have no result. The run ends when every
    rank not in ``frozen`` has exited, or at ``timeout``; then every process still alive is
    killed (exit code None: it had not exited by itself).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="xgrad-ranks-")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, fn, tuple(args), "file://" + os.path.join(tmp, "store"), out),
            daemon=True,
        )
        for r in range(world)
    ]
    results: dict[int, tuple[str, Any]] = {}
    codes: dict[int, int | None] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                rank, status, value = out.get(timeout=0.1)
                results[rank] = (status, value)
            except queue_module.Empty:
                pass
            if all(p.exitcode is not None for r, p in enumerate(procs) if r not in frozen):
                break
        while True:
            try:
                rank, status, value = out.get(timeout=0.2)
                results[rank] = (status, value)
            except queue_module.Empty:
                break
        for r, p in enumerate(procs):
            codes[r] = p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        out.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return results, codes
