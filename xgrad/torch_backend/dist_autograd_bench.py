"""``xgrad bench dist-autograd``: xgrad's distributed backward against PyTorch's RPC one.

The same graph runs through both, in the same processes: a chain through every rank and
back to rank 0; rank 0's activation also goes straight to the last rank (a fan-out; with
two ranks the same tensor is sent twice) and into the loss (a round trip and fan-ins)::

    rank 0: h0 = tanh(x @ W0) -> rank 1: tanh(h @ W1) -> ... -> last: tanh(h @ Wl) + h0
    -> rank 0: loss = sum(h * h0)

xgrad sends tensors with ``dist_autograd.send``/``recv`` on a gloo group; PyTorch calls
each next rank with nested ``rpc_sync`` over TensorPipe inside a
``torch.distributed.autograd`` context. Timed: ``backward`` on rank 0 (for xgrad, until
every rank finished its part). The two alternate in blocks of passes, in the same
processes; PyTorch's RPC agent is started for each of its blocks and shut down after,
because while it lives a thread of every process polls its shared-memory transport (an
idle agent made xgrad's pass 1.8 times slower). Each launch of fresh processes runs every
block; the ratio and its verdict come from the block pairs of every launch
(:mod:`.dist_autograd_report`). Also reported: rank 0's whole pass (the context from entry to
exit), the CPU time a pass costs
all ranks together (every thread, forward and backward: for PyTorch from when rank 0
starts its timed passes until it finished them, polling included), and the largest
difference between the two implementations' gradients of every weight.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

from xgrad.help_format import QuickDefault
from xgrad.tables import add_table_outputs, print_tables
from xgrad.torch_backend.dist_autograd_report import render, summarize

HELP = (
    "time per distributed backward of xgrad's dist_autograd (gloo) against PyTorch's "
    "torch.distributed.autograd over RPC (TensorPipe) on the same graph (ratio, target < 1)"
)

#: this process's weight, for the RPC stages (set in each worker before RPC starts).
_STATE: dict[str, Any] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=3, help="processes (ranks), >= 2")
    parser.add_argument(
        "--size", type=int, default=QuickDefault(256, 8), help="width of the square weights"
    )
    parser.add_argument("--batch", type=int, default=QuickDefault(64, 4), help="rows of the input")
    parser.add_argument(
        "--iters",
        type=int,
        default=QuickDefault(20, 2),
        help="timed backward passes each, per launch",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=QuickDefault(3, 1),
        help="untimed passes at the start of each block",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="blocks per implementation and launch (they alternate)",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=QuickDefault(6, 1),
        help="runs of fresh processes, each with every block: the verdict counts launches, "
        "since a launch's blocks share what its processes drew (from 6 on: the interval of "
        "the launches' median block ratios)",
    )
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument(
        "--ab",
        action="store_true",
        help="also time xgrad's other way to run a rank's graph (waves in torch's engine, or "
        "the node engine calling each grad_fn), pass by pass with the default in the same blocks",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and 2 passes (for the tests); an option given explicitly still wins",
    )
    add_table_outputs(parser, "the row (milliseconds, ratio, gradient difference)")


def _weights(world: int, size: int, batch: int, dtype: Any) -> tuple[Any, list[Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, size, generator=g, dtype=dtype)
    ws = [torch.randn(size, size, generator=g, dtype=dtype) / size**0.5 for _ in range(world)]
    return x, ws


def _rpc_stage(h: Any, h0: Any, rank: int, world: int) -> Any:
    import torch
    import torch.distributed.rpc as rpc

    h = torch.tanh(h @ _STATE["w"])
    if rank + 1 < world:
        return rpc.rpc_sync(f"w{rank + 1}", _rpc_stage, args=(h, h0, rank + 1, world))
    return h + h0


def _rpc_grad(context_id: int) -> Any:
    import torch.distributed.autograd as torch_da

    return torch_da.get_gradients(context_id)[_STATE["w"]]


def _xgrad_pass(
    rank: int, world: int, x: Any, w: Any, execute: str | None = None
) -> tuple[float, float, Any]:
    """``(backward seconds, whole pass seconds, gradient of w)`` of one pass of this rank."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    if execute is not None:
        da.EXECUTE = execute
    begin = time.perf_counter()
    with da.context() as cid:
        if rank == 0:
            h0 = torch.tanh(x @ w)
            da.send(h0, 1)
            da.send(h0, world - 1)
            roots = [(da.recv(world - 1) * h0).sum()]
        else:
            h = torch.tanh(da.recv(rank - 1) @ w)
            if rank == world - 1:
                h = h + da.recv(0)
            da.send(h, (rank + 1) % world)
            roots = []
        start = time.perf_counter()
        da.backward(cid, roots)
        seconds = time.perf_counter() - start
        grad = da.get_gradients(cid)[w]
    return seconds, time.perf_counter() - begin, grad


def _torch_pass(world: int, x: Any, w: Any, fetch: bool = False) -> tuple[float, float, list[Any]]:
    """One pass over RPC: ``(backward seconds, whole pass seconds, gradients)``; with
    ``fetch`` also every rank's gradient (one RPC per rank, for the check only: a timed
    pass leaves it out, it is neither forward nor backward)."""
    import torch
    import torch.distributed.autograd as torch_da
    import torch.distributed.rpc as rpc

    begin = time.perf_counter()
    with torch_da.context() as cid:
        h0 = torch.tanh(x @ w)
        loss = (rpc.rpc_sync("w1", _rpc_stage, args=(h0, h0, 1, world)) * h0).sum()
        start = time.perf_counter()
        torch_da.backward(cid, [loss])
        seconds = time.perf_counter() - start
        grads = []
        if fetch:
            grads = [torch_da.get_gradients(cid)[w]]
            grads += [rpc.rpc_sync(f"w{r}", _rpc_grad, args=(cid,)) for r in range(1, world)]
    return seconds, time.perf_counter() - begin, grads


def _blocks(iters: int, rounds: int) -> list[int]:
    """Timed passes of each block: ``iters`` split over ``rounds`` blocks per side."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    dtype = getattr(torch, cfg["dtype"])
    x, ws = _weights(world, cfg["size"], cfg["batch"], dtype)
    w = ws[rank].requires_grad_()
    _STATE["w"] = w
    ours: list[float] = []
    theirs: list[float] = []
    # Rank 0's whole pass: context entry to exit (forward, backward, the context's end).
    passes: dict[str, list[float]] = {"xgrad": [], "torch": []}
    mine = None
    grads: list[Any] = []
    # The two implementations alternate block by block, so that a change of the
    # machine's load during the run weighs on both alike, and each runs with only its own
    # machinery alive: PyTorch's RPC agent polls on a thread of every process while it
    # lives (its shared-memory transport), which slows every other computation.
    other: list[float] = []
    other_grad = None
    cpu = {"xgrad": 0.0, "torch": 0.0}  # this process's CPU (all threads) in timed passes
    for r, n in enumerate(_blocks(cfg["iters"], cfg["rounds"])):
        for i in range(cfg["warmup"] + n):
            before = time.process_time()
            seconds, whole, mine = _xgrad_pass(rank, world, x, w, cfg["execute"])
            if i >= cfg["warmup"]:
                ours.append(seconds)
                passes["xgrad"].append(whole)
                cpu["xgrad"] += time.process_time() - before
            dist.barrier()
            if cfg["ab"]:  # the other execution, pass by pass between the default's passes
                seconds, _, other_grad = _xgrad_pass(rank, world, x, w, cfg["ab"])
                if i >= cfg["warmup"]:
                    other.append(seconds)
                dist.barrier()
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"{cfg['rpc_init']}{r}", num_worker_threads=8, rpc_timeout=cfg["timeout"]
        )
        with warnings.catch_warnings():
            # RPC's own start-up gathers device maps on a Backend object and warns about
            # it, once per rank and block: PyTorch's deprecation, nothing the bench did.
            warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
        try:
            for _ in range(cfg["warmup"] if rank == 0 else 0):
                _torch_pass(world, x, w)
            # The others serve rank 0's calls on their RPC threads while they wait here.
            dist.barrier()
            before = time.process_time()
            for _ in range(n if rank == 0 else 0):
                seconds, whole, _ = _torch_pass(world, x, w)
                theirs.append(seconds)
                passes["torch"].append(whole)
            dist.barrier()
            cpu["torch"] += time.process_time() - before
            if rank == 0:  # the gradients to compare, from one more pass, untimed
                grads = _torch_pass(world, x, w, fetch=True)[2]
            dist.barrier()
        finally:
            rpc.shutdown()
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, other_grad, cpu))
    if rank != 0:
        return None
    pairs = list(zip(gathered, grads, strict=True))
    diff = max(float((a - b).abs().max()) for (a, _, _), b in pairs)
    result: dict[str, Any] = {
        "xgrad_times": ours,
        "torch_times": theirs,
        "blocks": _blocks(cfg["iters"], cfg["rounds"]),
        "diff": diff,
    }
    for side, times in passes.items():
        result[f"{side}_pass_times"] = times
    for side in ("xgrad", "torch"):  # per timed pass, summed over the ranks
        result[f"{side}_cpu"] = sum(c[side] for _, _, c in gathered) / cfg["iters"]
    if other:
        result["other_times"] = other
        result["other_diff"] = max(float((a - b).abs().max()) for (_, a, _), b in pairs)
    return result


def run(args: argparse.Namespace) -> int:
    from xgrad.torch_backend.spawn import spawn

    for label in ("world", "size", "batch", "iters", "rounds", "launches"):
        if getattr(args, label) < 1:
            raise ValueError(f"--{label} must be >= 1, got {getattr(args, label)}")
    if args.world < 2:
        raise ValueError(f"--world must be >= 2 for a distributed backward, got {args.world}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    import torch.distributed.rpc as rpc

    if not rpc.is_available():
        print("skipped: torch.distributed.rpc is not available in this build of torch")
        return 0
    from xgrad.torch_backend import dist_autograd

    execute = dist_autograd.EXECUTE
    tmp = tempfile.mkdtemp(prefix="xgrad-bench-rpc-")
    cfg = {
        "size": args.size, "batch": args.batch, "iters": args.iters, "warmup": args.warmup,
        "dtype": args.dtype, "timeout": args.timeout, "rounds": args.rounds,
        "rpc_init": "file://" + os.path.join(tmp, "rpc"), "execute": execute,
        "ab": args.ab and ("nodes" if execute == "waves" else "waves"),
    }  # fmt: skip
    launches = []
    try:
        for k in range(args.launches):
            # RPC's rendezvous files are per block; a launch of its own names its own.
            cfg["rpc_init"] = "file://" + os.path.join(tmp, f"rpc{k}-")
            launches.append(spawn(_worker, args.world, args=(cfg,), timeout=args.timeout)[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    blocks = len(_blocks(args.iters, args.rounds))
    text, tables = render(args, summarize(launches), execute, cfg["ab"] or None, blocks)
    print_tables(args, tables, text)
    return 0
