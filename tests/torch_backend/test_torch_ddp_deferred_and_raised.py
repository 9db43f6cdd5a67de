"""A step that fails on one rank as a pass left unreduced and on another as a raise.

A static graph whose graph changes on both ranks in one step, each its own way: rank 0
leaves a parameter out (its gradient never comes: the pass ends, and the error is
PyTorch's "prior iteration" one, deferred to the next forward pass), rank 1 uses one it
had left out (its hook raises at once, naming rank 0's failure, posted first). Rank 1
began the next step clean while rank 0 raised there, and from then on each of rank 1's
steps was averaged with rank 0's step after it, without a word; the last one waited out
the timeout. Now rank 1 raises the deferred failure at that forward pass too, and the
steps after are the mean of the same step on both ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 6


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.c = nn.Linear(16, 4)
        self.d = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_d: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(h) + self.d(h) if use_d else self.c(h)


def _uses_d(rank: int, step: int) -> bool:
    """Rank 0 uses ``d`` and rank 1 does not, but in step 1, where they swap."""
    return rank == 1 if step == 1 else rank == 0


def _is_the_mean(
    model: nn.Module, plain: nn.Module, x: torch.Tensor, use_d: bool, world: int
) -> list[bool]:
    """Whether each of the DDP's gradients is the mean over the ranks of ``plain``'s
    (the same weights, no DDP) on the same input (a missing gradient counts as zero)."""
    import torch.distributed as dist

    plain.zero_grad(set_to_none=True)
    plain(x, use_d).square().sum().backward()
    right = []
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        local = torch.zeros_like(q) if q.grad is None else q.grad.clone()
        dist.all_reduce(local)
        right.append(p.grad is not None and torch.allclose(p.grad, local / world))
    return right


def _run(rank: int, world: int) -> dict[str, Any]:
    import copy

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = _Branch()
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=True, static_graph=True, timeout=3)
    outcomes, right = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad(set_to_none=True)
        try:
            ddp(x, _uses_d(rank, step)).square().sum().backward()
        except Exception as exc:  # the outcome is what is compared
            outcomes.append(type(exc).__name__)
            continue
        outcomes.append("ok")
        if step >= 3:
            right += _is_the_mean(model, plain, x, _uses_d(rank, step), world)
    return {"outcomes": outcomes, "right": right}


def _in_step(first: dict[str, Any], second: dict[str, Any]) -> None:
    """From step 2 on both ranks ran the same steps (both raised, or neither), the last
    three each the mean of the same step on both. Before, a step apart: one rank's step 2
    raised where the other's ran, and the last one waited out the timeout."""
    for r in (first, second):
        assert r["outcomes"][0] == "ok" and r["outcomes"][3:] == ["ok"] * (STEPS - 3), r
    ran = [[o == "ok" for o in r["outcomes"][2:]] for r in (first, second)]
    assert ran[0] == ran[1], (first["outcomes"], second["outcomes"])
    assert first["right"] and all(first["right"]) and all(second["right"])


def test_every_rank_raises_the_deferred_failure_at_the_same_forward_pass() -> None:
    """Which failure the step's channel holds first is a race: rank 0's pass left
    unreduced (then rank 0 raises at step 2's forward pass, and rank 1, which raised in
    step 1, raises there again), or rank 1's raise (then rank 0 fails step 1 with it)."""
    first, second = spawn(_run, 2, timeout=90)
    assert first["outcomes"][1:3] in (["ok", "RuntimeError"], ["RankError", "ok"])
    _in_step(first, second)


def _comm_hook_raises(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 leaves ``d`` out of step 1 (no ``find_unused_parameters``: its pass is left
    unreduced) and is slow there; rank 1's comm hook raises in that step, first."""
    import copy
    import time

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = _Branch()
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, timeout=3)
    failing = [False]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # (torch reads the annotations)
        if failing[0]:
            raise ValueError("comm hook failed")
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    outcomes, right = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        use_d = not (rank == 0 and step == 1)
        failing[0] = rank == 1 and step == 1
        model.zero_grad(set_to_none=True)
        try:
            out = ddp(x, use_d)
            if not use_d:
                out.register_hook(lambda g: (time.sleep(0.5), g)[1])
            out.square().sum().backward()
        except Exception as exc:  # the outcome is what is compared
            outcomes.append(type(exc).__name__)
            continue
        outcomes.append("ok")
        if step >= 2:
            right += _is_the_mean(model, plain, x, use_d, world)
    return {"outcomes": outcomes, "right": right}


def test_a_peer_s_raise_posted_first_fails_the_pass_on_the_deferring_rank_too() -> None:
    """The other order: the peer's raise (its comm hook's) is the step's first failure,
    and the rank whose gradients never came deferred its own error all the same, to the
    next forward pass, where the peer began the next step clean: the same step apart,
    and the last step waited out the timeout. It fails the pass now, with the peer."""
    first, second = spawn(_comm_hook_raises, 2, timeout=90)
    # (rank 1's is also a ValueError, its own exception's type)
    assert [r["outcomes"][1][:9] for r in (first, second)] == ["RankError"] * 2
    _in_step(first, second)
