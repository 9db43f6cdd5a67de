"""Train a small MLP with xgrad's DDP: ``torchrun --nproc-per-node 2 examples/train_ddp.py``.

The script is an ordinary PyTorch DDP script with one import changed; it then prints
what PyTorch's DDP keeps to itself: the bucket plan before and after the rebuild, the
order in which gradients became ready, and where the backward pass spent its time.
Without torchrun (no ``RANK`` in the environment) it launches two local processes itself.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from xgrad.torch_backend import DistributedDataParallel, spawn


def train(rank: int, world_size: int, steps: int) -> float:
    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(99))
    loss = torch.tensor(0.0)
    for step in range(steps):
        x = torch.randn(64, 32, generator=data)
        y = torch.tanh(x @ w_true)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()  # returns once every bucket is reduced: .grad is the average
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    if rank == 0:
        stats = ddp.statistics()
        names = ddp.parameter_names
        nbytes = ddp.reducer.nbytes
        print("initial plan:\n" + ddp.initial_plan.table(nbytes, names))
        print("plan after the rebuild:\n" + ddp.plan.table(nbytes, names))
        print("gradient ready order:", ", ".join(stats["ready_order"]))
        print(
            "backward (ms): compute {:.3f}, communication {:.3f}, overlap {:.3f}".format(
                stats["avg_backward_compute_time"] * 1e3,
                stats["avg_backward_comm_time"] * 1e3,
                stats["avg_backward_compute_comm_overlap_time"] * 1e3,
            )
        )
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps)
        finally:
            dist.destroy_process_group()
    else:
        spawn(train, 2, args=(args.steps,))


if __name__ == "__main__":
    main()
