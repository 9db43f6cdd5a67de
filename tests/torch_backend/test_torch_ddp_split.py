"""A large bucket's all-reduce in halves at world size 2 (``ddp_split``): PyTorch's bits,
failures still reach every rank, and nothing is cut where the bits could change."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.ddp_split import MIN_BYTES, SPLIT_ENV, pieces, wanted_pieces
from xgrad.torch_backend.spawn import spawn

_BIG = torch.zeros(MIN_BYTES // 4)


@pytest.mark.parametrize(
    ("buffer", "world", "backend", "expected"),
    [
        (_BIG, 2, "gloo", 2),
        (_BIG, 3, "gloo", 1),  # gloo's ring order follows the position: kept whole
        (_BIG, 2, "nccl", 1),
        (_BIG[:-1], 2, "gloo", 1),  # under MIN_BYTES
        (torch.zeros(MIN_BYTES // 8, dtype=torch.complex64), 2, "gloo", 1),
        (torch.zeros(MIN_BYTES // 8, dtype=torch.float64), 2, "gloo", 2),
    ],
)
def test_only_two_ranks_on_gloo_cut_a_large_real_bucket(
    buffer: torch.Tensor, world: int, backend: str, expected: int
) -> None:
    assert pieces(buffer, 2, world, backend) == expected
    assert pieces(buffer, 1, world, backend) == 1


def test_the_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    assert wanted_pieces() == 2
    monkeypatch.setenv(SPLIT_ENV, "1")
    assert wanted_pieces() == 1
    for bad in ("two", "0", "-3"):
        monkeypatch.setenv(SPLIT_ENV, bad)
        with pytest.raises(ValueError, match=f"{SPLIT_ENV}='{bad}'"):
            wanted_pieces()


def _model() -> nn.Module:
    # Buckets (reverse order, 1 MiB first cap): [bias, 1024x1024 weight] = 4 MB, cut in
    # halves; then the first layer's 260 KB, kept whole.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024))


def _counting(monkeypatch_target: Any) -> list[int]:
    """Count the buckets reduced in halves (the module's ``Halves``, wrapped)."""
    cuts = [0]
    original = monkeypatch_target.Halves

    class Counted(original):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, works: Any, buffer: torch.Tensor) -> None:
            cuts[0] += 1
            super().__init__(works, buffer)

    monkeypatch_target.Halves = Counted
    return cuts


def _bits(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel, ddp_watched_comm

    cuts = _counting(ddp_watched_comm)
    base = _model()
    grads: list[list[list[torch.Tensor]]] = []
    for cls in (DistributedDataParallel, TorchDDP):
        model = copy.deepcopy(base)
        ddp = cls(model, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(8, 64, generator=g)).tanh().square().sum().backward()
            steps.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        grads.append(steps)
    ours, theirs = grads
    equal = all(
        torch.equal(a, b)
        for step, ref in zip(ours, theirs, strict=True)
        for a, b in zip(step, ref, strict=True)
    )
    return {"equal": equal, "cuts": cuts[0], "world": world}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"find_unused_parameters": True}, {"gradient_as_bucket_view": True}],
    ids=["plain", "find_unused", "as_view"],
)
def test_halves_give_pytorchs_bits_at_world_size_2(kwargs: dict[str, Any]) -> None:
    for result in spawn(_bits, 2, args=(kwargs,), timeout=120):
        assert result["equal"]
        assert result["cuts"] == 3  # the 4 MB bucket of each step; the small one whole


def test_three_ranks_keep_every_bucket_whole() -> None:
    for result in spawn(_bits, 3, args=({},), timeout=120):
        assert result["equal"]
        assert result["cuts"] == 0


def _fail_then_step(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel, ddp_watched_comm

    cuts = _counting(ddp_watched_comm)
    model = _model()
    ddp = DistributedDataParallel(model, timeout=20.0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 64, generator=g)
    ddp(x).square().sum().backward()  # a good first step (and the rebuild)
    first = model[0].weight

    def boom(grad: torch.Tensor) -> torch.Tensor:
        # The second layer's bucket, cut in halves, is in flight by now.
        raise ValueError("boom on rank 1")

    handle = first.register_hook(boom) if rank == 1 else None
    start = time.perf_counter()
    error, origin = "", None
    try:
        model.zero_grad()
        ddp(x).square().sum().backward()
    except Exception as exc:  # rank 1: its own ValueError; rank 0: a RankError naming it
        error = f"{type(exc).__name__}: {exc}"
        origin = getattr(exc, "rank", None)
    took = time.perf_counter() - start
    if handle is not None:
        handle.remove()
    # The next step works, and is the average of the two ranks' own gradients.
    model.zero_grad()
    ddp(x).square().sum().backward()
    reduced = [p.grad.clone() for p in model.parameters()]
    local = _model()  # the same parameters: no step was taken
    local(x).square().sum().backward()
    mine = [p.grad for p in local.parameters()]
    every = [[torch.empty_like(t) for _ in range(world)] for t in mine]
    for out, t in zip(every, mine, strict=True):
        torch.distributed.all_gather(out, t)
    average = [sum(ts[1:], ts[0]) / world for ts in every]
    return {
        "error": error,
        "origin": origin,
        "took": took,
        "cuts": cuts[0],
        "next": all(torch.equal(a, b) for a, b in zip(reduced, average, strict=True)),
    }


def test_a_failure_with_halves_in_flight_reaches_every_rank_and_the_next_step_works() -> None:
    results = spawn(_fail_then_step, 2, timeout=120)
    assert results[1]["error"] == "ValueError: boom on rank 1"
    assert results[0]["error"].startswith("RankError: rank 1"), results[0]
    assert results[0]["origin"] == 1
    for result in results:
        assert result["took"] < 10.0  # named by the failure channel, not the 20 s timeout
        assert result["next"]
        assert result["cuts"] >= 2
