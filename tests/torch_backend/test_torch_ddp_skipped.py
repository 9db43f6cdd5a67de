"""A step whose backward pass never reached DDP on some ranks, with three real gloo ranks.

Left alone, the peers' reduction of that step would be completed by the skipping rank's
next step, and every later step would reduce one rank's step with another's, silently.
One run goes through: a backward that raises on rank 1 before any DDP hook (a hook on
the model's output; the peers raise its exception), a forward pass every rank runs without a backward (legal, no
error), a rank that leaves its backward out, and two forward passes with one backward;
every step after each must give the full batch's gradients on every rank. Another run
kills a rank while its peer waits in the round that settles such a step.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from ranks import run_ranks
from steps import recorded

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
SHARD = 4
#: what each step does, on which ranks (others run an ordinary step)
PLAN: dict[int, tuple[str, set[int]]] = {
    1: ("raise before DDP", {1}),
    3: ("no backward", {0, 1, 2}),
    5: ("no backward", {2}),
    7: ("two forwards", {0, 1, 2}),
}


def _sequence(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SHARD * world, 5, generator=g), torch.randn(SHARD * world, 2, generator=g)
    ref = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    ref.load_state_dict(model.state_dict())
    ((ref(x) - y) ** 2).mean().backward()
    expected = {n: p.grad.clone() for n, p in ref.named_parameters()}
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    ddp = DistributedDataParallel(model, timeout=6.0)

    def boom(grad: Any) -> Any:
        raise RuntimeError(f"boom before DDP on rank {rank}")

    steps: list[dict[str, Any]] = []
    skip_round: list[str] = []  # rank 0's skip round of step 3, seen at step 4
    for s in range(9):
        kind, ranks = PLAN.get(s, ("", set()))
        mine = kind if rank in ranks else ""
        model.zero_grad()
        record: dict[str, Any] = {"error": "", "origin": None, "correct": None, "scale": 1.0}

        def body(record: dict[str, Any] = record, s: int = s, mine: str = mine) -> None:
            out = ddp(xs)
            rounds = getattr(ddp._watch, "skipped_steps", [])
            if s == 4 and rank == 0 and rounds:
                skip_round.append(rounds[-1][1])
            loss = ((out - ys) ** 2).mean()
            if mine == "raise before DDP":
                out.register_hook(boom)
            if mine == "two forwards":
                loss = loss + ((ddp(xs) - ys) ** 2).mean()
                record["scale"] = 2.0
            if mine != "no backward":
                loss.backward()
                record["correct"] = all(
                    torch.allclose(p.grad, record["scale"] * expected[n], atol=1e-6)
                    for n, p in model.named_parameters()
                )

        steps.append(recorded(record, body))
    store = ddp._watch.channel.store
    left = bool(skip_round) and store.check([f"{skip_round[0]}/skipped/1"])
    return {"steps": steps, "skip_round": "".join(skip_round), "left": left}


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, Any]]:
    results, codes = run_ranks(_sequence, 3, timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    for status, value in results.values():
        assert status == "ok", value
    return {r: v for r, (_, v) in results.items()}


def test_a_backward_raising_before_ddp_on_one_rank_is_named_by_its_peers(runs: Any) -> None:
    assert "boom before DDP on rank 1" in runs[1]["steps"][1]["error"]
    for rank in (0, 2):
        step = runs[rank]["steps"][1]
        assert "rank 1 in backward" in step["error"], step
        # The exception itself, noted as it left autograd (ddp_cut_short), not the skip
        # round's "never reached DDP", which a pass left without its backward still gets.
        assert "boom before DDP on rank 1" in step["error"], step
        assert step["origin"] == 1
        assert step["seconds"] < 5.0, step  # the wait polls every 20 ms; room for a loaded machine


def test_a_rank_leaving_its_backward_out_is_named_by_its_peers(runs: Any) -> None:
    assert runs[2]["steps"][5]["error"] == ""  # it raised nothing itself
    for rank in (0, 1):
        assert "rank 2 in backward" in runs[rank]["steps"][5]["error"], runs[rank]["steps"][5]
    # Its next forward pass tells it, as every rank moves to a fresh group.
    assert "rank 2 in backward" in runs[2]["steps"][6]["warning"]


def test_every_rank_skipping_the_backward_is_legal_and_silent(runs: Any) -> None:
    for rank, run in runs.items():
        for s in (3, 4):
            assert run["steps"][s]["error"] == "", (rank, s, run["steps"][s])
            assert run["steps"][s]["warning"] == "", (rank, s, run["steps"][s])


def test_every_step_after_a_skip_gives_the_full_batch_gradients(runs: Any) -> None:
    for rank, run in runs.items():
        for s in (0, 2, 4, 6, 7, 8):
            step = run["steps"][s]
            assert step["error"] == "" and step["correct"], (rank, s, step)


def test_a_skip_rounds_keys_are_deleted_two_steps_later(runs: Any) -> None:
    assert runs[0]["skip_round"], "rank 0 recorded no skip round at step 4"
    assert not runs[0]["left"]


def _peer_dies_during_the_round(rank: int, world: int) -> dict[str, Any]:
    import signal

    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(3, 2), timeout=30.0)
    x = torch.randn(4, 3)
    ddp(x).sum().backward()
    ddp(x)  # no backward: the next forward pass settles the step with the peers
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        ddp(x)  # the skip round: rank 0 never answers
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": "", "seconds": time.monotonic() - start}


def test_a_peer_dying_during_a_skip_round_is_named_not_waited_for() -> None:
    results, codes = run_ranks(_peer_dies_during_the_round, 2, timeout=60)
    status, value = results[1]
    assert status == "ok", value
    assert "rank 0" in value["error"] and "stopped answering" in value["error"], value
    assert value["seconds"] < 15.0, value  # heartbeats time out in 2 s; not the 30 s timeout
    assert codes[1] == 0


def _accumulating_after_a_skip(rank: int, world: int) -> list[Any]:
    """Rank 1's backward raises before DDP at step 1; steps 2 and 3 accumulate two
    ``no_sync`` micro-batches before their synchronised one (as a pipeline's do)."""
    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, timeout=6.0)

    def boom(grad: Any) -> Any:
        raise RuntimeError("boom before DDP")

    out: list[Any] = []
    for step in range(4):
        model.zero_grad()
        start = time.monotonic()
        try:
            if step < 2:
                y = ddp(torch.ones(3, 4))
                if step == 1 and rank == 1:
                    y.register_hook(boom)
                y.sum().backward()
            else:
                for _ in range(2):
                    with ddp.no_sync():
                        ddp(torch.ones(3, 4)).sum().backward()
                ddp(torch.ones(3, 4)).sum().backward()
            out.append(("ok", time.monotonic() - start))
        except Exception as exc:
            out.append((str(exc), time.monotonic() - start))
    return out


def test_an_accumulation_after_a_skipped_backward_begins_the_next_step_at_once() -> None:
    """The skipping rank settled the skipped step at its next forward, a no_sync one, but
    kept the step's backward pending: its next no_sync pass settled the new step too, and
    waited out the timeout for peers that had skipped nothing there (then named itself)."""
    results, codes = run_ranks(_accumulating_after_a_skip, 2, timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        for step in (2, 3):
            word, seconds = out[step]
            assert word == "ok" and seconds < 3.0, (rank, step, out)
