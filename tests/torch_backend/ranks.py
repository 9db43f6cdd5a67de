"""A test launcher that keeps going when a rank dies or freezes on purpose.

``xgrad.torch_backend.spawn`` stops at the first failing rank; the failure tests need the
survivors' results (what they raised, how fast) and whether they then exit cleanly. The
launcher is :func:`xgrad.torch_backend.gather.gather_ranks`, which the fault bench uses too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from xgrad.torch_backend.gather import gather_ranks


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 90.0,
    frozen: Sequence[int] = (),
) -> tuple[dict[int, tuple[str, Any]], dict[int, int | None]]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; results and exit codes by rank.

    Results are ``("ok", value)`` or ``("error", text)``. Ranks that return nothing
    (killed, frozen) have no result. The run ends when every rank not in ``frozen`` has
    exited, or at ``timeout``; then every process still alive is killed (exit code None:
    it had not exited by itself).
    """
    wait_for = [r for r in range(world) if r not in frozen]
    return gather_ranks(fn, world, args, limit=timeout, wait_for=wait_for)


def key_count(store: Any) -> int:
    """The store's number of keys, read with every rank at the same point of its run (the
    store-key tests count what failed and good steps leave)."""
    import torch.distributed as dist

    dist.barrier()
    n = int(store.num_keys())
    dist.barrier()
    return n


def armed_linear() -> tuple[Any, list[bool]]:
    """``Linear(4, 2)`` (seed 0) whose forward pass raises ``ValueError("boom")`` once each
    time ``armed[0]`` is set to ``True`` (the failure tests' failing forward pass)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    armed = [False]

    def pre_hook(module: torch.nn.Module, inputs: object) -> None:
        if armed[0]:
            armed[0] = False
            raise ValueError("boom")

    model.register_forward_pre_hook(pre_hook)
    return model, armed


def armed_between(rank: int) -> tuple[Any, dict[str, bool]]:
    """``Linear(4, 4), Tanh, Linear(4, 2)`` (seed 0) whose backward pass raises
    ``ValueError("boom on rank R")`` between the layers (after DDP's first gradient hooks
    ran) once each time ``armed["on"]`` is set to ``True`` (a backward pass cut short)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    armed = {"on": False}

    def boom(grad: Any) -> Any:
        if armed["on"]:
            armed["on"] = False
            raise ValueError(f"boom on rank {rank}")
        return grad

    def between(module: Any, inputs: Any, output: Any) -> None:
        output.register_hook(boom)

    model[1].register_forward_hook(between)
    return model, armed


def armed_hook() -> tuple[Any, list[bool]]:
    """A DDP communication hook that raises ``ValueError("hook boom")`` once each time
    ``armed[0]`` is set to ``True``, else PyTorch's all-reduce hook (the failure tests'
    failing backward pass)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    armed = [False]

    # (annotated as PyTorch's check of a comm hook asks)
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if armed[0]:
            armed[0] = False
            raise ValueError("hook boom")
        return allreduce_hook(state, bucket)

    return hook, armed


def every_rank_ok(fn: Callable[..., Any], world: int, *, timeout: float) -> dict[int, Any]:
    """:func:`run_ranks` where every rank must exit cleanly and return: each rank's value."""
    results, codes = run_ranks(fn, world, timeout=timeout)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert all(status == "ok" for status, _ in results.values()), results
    return {rank: value for rank, (_, value) in results.items()}


def run_plain(
    script: str, world: int, init: str, args: Sequence[str] = (), *, timeout: float = 120.0
) -> list[tuple[int | None, str, str]]:
    """Run ``python -c script RANK INIT *args`` as ``world`` plain processes (not
    multiprocessing children: their exit is a script's, with no launcher's destroy after
    it), this checkout on the path; each one's exit code, stdout and stderr, by rank.
    Each is killed if it has not ended within ``timeout``."""
    import xgrad

    root = os.path.dirname(os.path.dirname(xgrad.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), init, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outs, strict=True)]
