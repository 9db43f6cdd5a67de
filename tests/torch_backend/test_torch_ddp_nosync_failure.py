"""A ``no_sync`` backward pass that raises gives up its step on every rank.

Gradient accumulation on two gloo ranks: a ``no_sync`` micro-batch, then a synchronised
one, per step. At step 1 a hook on rank 1 raises in the ``no_sync`` backward pass; both
ranks catch it and go on. That rank then skipped its synchronised micro-batch, and rank
0's reduction of step 1 paired with rank 1's of step 2: rank 0 raised nothing and every
later step's gradients were wrong, without a word. Now rank 0 raises at step 1, naming
rank 1, and the next steps' gradients are the average of both ranks'. The same with a
loop that catches the failure per micro-batch and goes on with the step's synchronised
one on rank 1: that pass is the failed step's, and raises its failure there too.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from xgrad.torch_backend.spawn import spawn


def _data(step: int, rank: int, micro: int) -> torch.Tensor:
    return torch.randn(
        3, 4, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    )


def _steps(rank: int, world: int, per_micro: bool = False) -> list[Any]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(net.state_dict())
    ddp = DistributedDataParallel(net, timeout=10.0)
    fail = {"on": False}

    def hook(g: torch.Tensor) -> torch.Tensor:
        if fail["on"]:
            fail["on"] = False
            raise ValueError("boom in a no_sync backward pass")
        return g

    net.weight.register_hook(hook)
    out: list[Any] = []
    for step in range(4):
        ddp.zero_grad()
        try:
            try:
                with ddp.no_sync():
                    fail["on"] = rank == 1 and step == 1
                    ddp(_data(step, rank, 0)).pow(2).mean().backward()
            except Exception as exc:
                if not per_micro:
                    raise
                out.append(f"no_sync: {exc}")  # and on with the step's next micro-batch
            ddp(_data(step, rank, 1)).pow(2).mean().backward()
        except Exception as exc:
            out.append(str(exc))
            continue
        ref.zero_grad()
        for r in range(world):
            for micro in (0, 1):
                ref(_data(step, r, micro)).pow(2).mean().backward()
        want = [p.grad / world for p in ref.parameters()]  # type: ignore[operator]
        pairs = zip(net.parameters(), want, strict=True)
        out.append(all(torch.allclose(p.grad, w, atol=1e-6) for p, w in pairs))
    return out


def test_a_failed_no_sync_backward_is_raised_on_every_rank_and_the_next_steps_are_right() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = spawn(_steps, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out[0] is True and out[2] is True and out[3] is True, (rank, out)
        if rank == 0:
            assert out[1].startswith("rank 1 in backward"), out
        else:
            assert "boom in a no_sync backward pass" in out[1], out


def test_a_loop_that_goes_on_with_the_failed_steps_synchronised_pass_raises_there_too() -> None:
    """A try per micro-batch: rank 1 catches its no_sync failure and runs the step's
    synchronised micro-batch. That pass began the next step on rank 1 while rank 0 was
    still in the failed one: every later step paired with rank 0's next one, wrong without
    a word. Now it is the failed step's, and raises its failure on both ranks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = spawn(_steps, 2, args=(True,), timeout=90)
    for rank, out in enumerate(results):
        if rank == 1:
            assert out[1].startswith("no_sync: ") and "boom" in out[1], out
            out = out[:1] + out[2:]
        assert out[0] is True and out[2] is True and out[3] is True, (rank, out)
        assert out[1].startswith("rank 1 in backward"), (rank, out)


def test_the_peers_read_the_text_of_what_a_no_sync_backward_pass_raised() -> None:
    """The exception that cut rank 1's ``no_sync`` pass short reaches rank 0 with its type
    and text, as a synchronised pass's does (:mod:`xgrad.torch_backend.ddp_cut_short`):
    rank 0 read only "a no_sync backward pass raised an exception". With a try per
    micro-batch rank 1's synchronised pass of the failed step raises it too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_step = spawn(_steps, 2, timeout=90)
        per_micro = spawn(_steps, 2, args=(True,), timeout=90)
    named = "rank 1 in backward: ValueError: boom in a no_sync backward pass"
    assert per_step[0][1] == named, per_step
    assert per_micro[0][1] == named and per_micro[1][2] == named, per_micro
    for out in (*per_step, *per_micro):
        assert out[-1] is True and out[-2] is True, out
