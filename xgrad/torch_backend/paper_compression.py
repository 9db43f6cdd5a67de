"""The compression experiment's torch rank worker: DDP with PyTorch's fp16/bf16 and PowerSGD
comm hooks on xgrad's DDP, training the same MLP as the JAX run.

Spawned by :mod:`xgrad.experiments.compression` through the registry; module-level so the
spawner pickles it by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["compression_worker"]


def _grad(param: Any) -> Any:
    """A parameter's gradient, which DDP's backward must have written."""
    if param.grad is None:
        raise RuntimeError(f"parameter of shape {tuple(param.shape)} got no gradient")
    return param.grad


@contextlib.contextmanager
def _counting_allreduces(counted: list[int]) -> Iterator[None]:
    """Adds to ``counted`` the bytes of every tensor given to ``dist.all_reduce`` inside:
    what a comm hook (PyTorch's call ``dist.all_reduce``) hands to the wire, measured
    rather than worked out from the shapes."""
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce = real


def compression_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the compression experiment: per variant of ``cfg["variants"]`` (none,
    fp16, bf16, PowerSGD rank r), the averaged losses and the gradient's relative error at
    the first compressed step ``cfg["start"]``; ``cfg["lr"]`` and ``cfg["min_rate"]`` as
    the experiment sets them; with a hook, ``wire_bytes``: the bytes its collectives carried
    in the last step (a compressed one)."""
    start_iter, lr = cfg["start"], cfg["lr"]
    ddp_cls = DistributedDataParallel
    x, y = (torch.from_numpy(a) for a in cfg["batch"])
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    out = {}
    for name, r in cfg["variants"].items():
        layers = nn.ModuleList(
            nn.Linear(w.shape[1], w.shape[0]) for k, w in cfg["weights"].items() if "weight" in k
        )
        with torch.no_grad():
            for k, w in cfg["weights"].items():
                layers.get_submodule(k.split(".", 1)[1].rsplit(".", 1)[0]).get_parameter(
                    k.rsplit(".", 1)[1]
                ).copy_(torch.from_numpy(w))

        def forward(inp: Any, layers: Any = layers) -> Any:
            for i, layer in enumerate(layers):
                inp = layer(inp)
                inp = torch.tanh(inp) if i < len(layers) - 1 else inp
            return inp

        model = nn.Module()
        model.layers = layers
        model.forward = forward  # type: ignore[method-assign]
        ddp = ddp_cls(model, bucket_cap_mb=1000)  # one bucket: PowerSGD on gloo needs it
        if name in ("fp16", "bf16"):
            ddp.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
        elif r:
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=r,
                start_powerSGD_iter=start_iter,
                min_compression_rate=cfg["min_rate"],
                random_seed=cfg["seed"],
            )
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        params = list(model.parameters())
        losses, error, counted = [], 0.0, list[int]()
        for step in range(cfg["steps"]):
            loss = (forward(x) - y).square().mean()
            if step == start_iter:  # the first compressed step: the exact average for reference
                exact = torch.autograd.grad(loss, params, retain_graph=True)
                flat = torch.cat([g.reshape(-1) for g in exact])
                dist.all_reduce(flat)
                flat /= world
            for p in params:
                p.grad = None
            loss = (ddp(x) - y).square().mean()
            with (
                _counting_allreduces(counted)
                if step == cfg["steps"] - 1
                else contextlib.nullcontext()
            ):
                loss.backward()
            if step == start_iter:
                got = torch.cat([_grad(p).reshape(-1) for p in params])
                error = float((got - flat).norm() / flat.norm())
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            losses.append(float(whole) / world)
            with torch.no_grad():
                for p in params:
                    p.sub_(lr * _grad(p))
        out[name] = {"losses": losses, "error": error}
        if name != "none":
            out[name]["wire_bytes"] = sum(counted)
    return out
