"""The torch experiments' rank workers: overlap, no_sync, allreduce size, bucket size.

Spawned by :mod:`xgrad.experiments` through the registry (``get_backend("torch")``), one
gloo rank each; they are module-level so that the spawner pickles them by name. What they
time and return is what the experiments' reports are made of.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from xgrad.link import make_link
from xgrad.torch_backend.ddp import DistributedDataParallel
from xgrad.torch_backend.paper_parts import linked_hook, median_seconds, mlp

__all__ = ["allreduce_worker", "bucket_worker", "no_sync_worker", "overlap_worker"]


def _grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, which the backward pass must have written."""
    if param.grad is None:
        raise RuntimeError(f"parameter of shape {tuple(param.shape)} got no gradient")
    return param.grad


def _sleep_until(finish: float) -> None:
    """Sleep until ``perf_counter()`` reaches ``finish`` (a time read twice may have
    passed it in between: a negative sleep raises ``ValueError``)."""
    left = finish - time.perf_counter()
    if left > 0:
        time.sleep(left)


def overlap_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the overlap experiment: median forward and total times per mode of
    ``cfg["modes"]`` (interleaved), the bucket count and the layers' bytes."""

    link = make_link(cfg["link"], cfg["alpha"], cfg["beta"], world)
    model = mlp(cfg["width"], cfg["layers"], cfg["seed"])
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=cfg["cap_mb"], first_bucket_cap_mb=cfg["cap_mb"]
    )
    ddp.register_hook(linked_hook(link)(ddp.comm))
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    def reduce_after() -> None:
        for bucket in ddp.plan.buckets:
            flat = torch.cat([_grad(params[i]).reshape(-1) for i in bucket])
            # As in DDP's hook: the link is booked at launch, the reduction runs within it.
            finish = link.reserve(flat.numel() * flat.element_size()) if link else 0.0
            dist.all_reduce(flat)
            _sleep_until(finish)
            flat /= world
            offset = 0
            for i in bucket:
                n = params[i].numel()
                _grad(params[i]).copy_(flat[offset : offset + n].view_as(params[i]))
                offset += n

    def step(mode: str) -> tuple[float, float]:
        ddp.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        if mode == "overlap":
            loss = ddp(x).square().mean()
            mid = time.perf_counter()
            loss.backward()
        else:
            with ddp.no_sync():
                loss = ddp(x).square().mean()
                mid = time.perf_counter()
                loss.backward()
            if mode == "no_overlap":
                reduce_after()
        end = time.perf_counter()
        return mid - start, end - start

    # The first steps build and rebuild the buckets; every mode gets a warm-up.
    for _ in range(2):
        for mode in cfg["modes"]:
            step(mode)
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in cfg["modes"]}
    for _ in range(cfg["steps"]):
        for mode in cfg["modes"]:  # interleaved so that drift in the load hits all alike
            samples[mode].append(step(mode))
    layer_bytes = [p.numel() * p.element_size() for p in params]
    return {
        m: {
            "forward": statistics.median(s[0] for s in v),
            "total": statistics.median(s[1] for s in v),
        }
        for m, v in samples.items()
    } | {"buckets": len(ddp.plan.buckets), "layer_bytes": layer_bytes}


def no_sync_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the no_sync experiment: per n of ``cfg["ns"]``, the median time of one
    sync step of n microbatches, bytes sent, gradient error (rank 0) and compute alone."""

    link = make_link(cfg["link"], cfg["alpha"], cfg["beta"], world)
    model = mlp(cfg["width"], cfg["layers"], cfg["seed"])
    reference = copy.deepcopy(model).double()
    ddp = DistributedDataParallel(model)
    sent = [0]

    def counting(comm: Any) -> Any:
        inner = linked_hook(link)(comm)

        def hook(bucket: Any) -> Any:
            buf = bucket.buffer()
            sent[0] += buf.numel() * buf.element_size()
            return inner(bucket)

        return hook

    ddp.register_hook(counting(ddp.comm))
    b = cfg["batch"]
    out: dict[str, Any] = {}
    for n in cfg["ns"]:
        # The global batch of one sync: n microbatches on each of the ranks.
        g = torch.Generator().manual_seed(cfg["seed"] + n)
        xs = torch.randn(n, world, b, cfg["width"], generator=g)

        def sync_step(n: int = n, xs: Any = xs) -> None:
            ddp.zero_grad(set_to_none=False)
            for k in range(n - 1):
                with ddp.no_sync():
                    ddp(xs[k, rank]).square().mean().backward()
            ddp(xs[n - 1, rank]).square().mean().backward()

        sync_step()  # warm-up (and the bucket rebuild)
        sent[0] = 0
        times = []
        for _ in range(cfg["steps"]):
            torch.distributed.barrier()
            start = time.perf_counter()
            sync_step()
            times.append(time.perf_counter() - start)
        nbytes = sent[0] / cfg["steps"]
        error = 0.0
        if rank == 0:
            reference.zero_grad()
            reference(xs.reshape(-1, cfg["width"]).double()).square().mean().backward()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                got = _grad(p).double() / n
                error = max(error, float((got - _grad(q)).abs().max() / _grad(q).abs().max()))
        # Compute alone: the same n microbatches with no reduction at all.
        with ddp.no_sync():
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                for k in range(n):
                    ddp(xs[k, rank]).square().mean().backward()
            compute = (time.perf_counter() - start) / cfg["steps"]
        out[str(n)] = {
            "time": statistics.median(times),
            "bytes": nbytes,
            "error": error,
            "compute": compute,
        }
    return out


def allreduce_worker(
    rank: int, world: int, sizes: list[int], reps: int, link_cfg: Any
) -> list[float]:
    """One rank of the allreduce-size experiment: the median seconds of an allreduce per
    size (after one warm-up), through the simulated link if ``link_cfg`` asks for it."""

    link = make_link(link_cfg[0], link_cfg[1], link_cfg[2], world)
    out = []
    for n in sizes:
        buf = torch.ones(n, dtype=torch.float32)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if link is not None:
                link.wait(n * 4)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def bucket_worker(rank: int, world: int, cfg: dict[str, Any]) -> list[tuple[int, float, float]]:
    """Per cap: buckets, median iteration seconds, and the link's modelled busy seconds."""

    link = make_link(cfg["link"], cfg["alpha"], cfg["beta"], world)
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    out = []
    for cap in cfg["caps"]:
        model = mlp(cfg["width"], cfg["layers"], cfg["seed"])
        mib = cap / 2**20
        ddp = DistributedDataParallel(model, bucket_cap_mb=mib, first_bucket_cap_mb=mib)
        ddp.register_hook(linked_hook(link)(ddp.comm))

        def step(ddp: Any = ddp) -> None:
            ddp.zero_grad(set_to_none=False)
            ddp(x).square().mean().backward()

        seconds = median_seconds(step, warmup=2, steps=cfg["steps"])
        sizes = ddp.statistics()["bucket_sizes"]
        busy = sum(link.seconds(b) for b in sizes) if link is not None else float("nan")
        out.append((len(ddp.plan.buckets), seconds, busy))
    return out
