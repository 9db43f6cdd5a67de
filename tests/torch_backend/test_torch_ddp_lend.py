"""Lent bucket views: gradients equal PyTorch's DDP bit for bit, whoever holds what.

The counting helpers run in this process; the DDP scenarios run in one spawned gloo
group of 3 ranks (an odd world size: the pre-division by 3 is not exact), each step
compared with PyTorch's DDP on the same model, data and zeroing pattern.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.ddp_lend import LEND_NUMEL, lend_sole, lendable, sole_grad, views_free
from xgrad.torch_backend.spawn import spawn

# ----------------------------------------------------------------- in process


def _fresh_param() -> nn.Parameter:
    p = nn.Parameter(torch.randn(4, 4))
    (p * 3).sum().backward()
    return p


def test_sole_grad_sees_every_other_holder() -> None:
    p = _fresh_param()
    assert sole_grad(p)  # autograd's fresh gradient, held by the parameter only
    held = p.grad
    assert not sole_grad(p)  # a reference kept elsewhere
    del held
    assert sole_grad(p)
    alias = p.grad.view(16)  # type: ignore[union-attr]
    assert not sole_grad(p)  # its storage is shared
    del alias
    flat = torch.zeros(32)
    p.grad = flat[:16].view(4, 4)
    assert not sole_grad(p)  # a view of someone's buffer
    p.grad = None
    assert sole_grad(p)


def test_lend_sole_lends_exactly_where_sole_grad_holds() -> None:
    """The batched loop makes the same decision as :func:`sole_grad`, holder by holder."""
    params = [_fresh_param() for _ in range(5)]
    held = params[1].grad
    alias = params[2].grad.view(16)  # type: ignore[union-attr]
    params[3].grad = torch.zeros(32)[:16].view(4, 4)  # a view of someone's buffer
    params[4].grad = None
    expected = [sole_grad(p) for p in params]
    assert expected == [True, False, False, False, True]
    views = [torch.full((4, 4), float(k)) for k in range(5)]
    assert lend_sole(params, [0, 1, 2, 3, 4], views) == expected
    for k, p in enumerate(params):
        assert (p.grad is views[k]) == expected[k]
    assert params[1].grad is held and alias.data_ptr() == params[2].grad.data_ptr()  # type: ignore[union-attr]
    q = _fresh_param()  # under no_grad too, as the end-of-backward callback may run
    with torch.no_grad():
        assert lend_sole([q], [0], [views[0]]) == [True]


def test_views_free_until_a_lent_view_is_held() -> None:
    flat = torch.zeros(40)
    views = [flat[:16].view(4, 4), flat[16:].view(4, 6)]
    assert views_free(flat, views, [0, 1])
    p = nn.Parameter(torch.zeros(4, 4))
    p.grad = views[0]
    assert not views_free(flat, views, [0])  # still a gradient
    kept = p.grad
    p.grad = None
    assert not views_free(flat, views, [0])  # kept by someone
    del kept
    assert views_free(flat, views, [0])
    part = flat[2:5]
    assert not views_free(flat, views, [0])  # another view of the buffer
    del part
    assert views_free(flat, views, [0, 1])


def test_counts_are_taken_the_same_under_no_grad_and_inference_mode() -> None:
    from xgrad.torch_backend.ddp_lend import _calibrate

    expected = _calibrate()
    with torch.no_grad():
        assert _calibrate() == expected
    with torch.inference_mode():
        assert _calibrate() == expected


def test_only_large_dense_contiguous_parameters_are_lendable() -> None:
    assert lendable(torch.zeros(LEND_NUMEL))
    assert not lendable(torch.zeros(LEND_NUMEL - 1))
    assert not lendable(torch.zeros(256, 128).t())


# ----------------------------------------------------------------- in a gloo group


class _Wide(nn.Module):
    """Two lendable weights, small ones beside them in the same buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 128)
        self.c = nn.Linear(128, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


#: per step, how the gradients are zeroed and what the caller holds on to.
_PATTERN = (
    *("none", "none", "none", "keep", "none", "zero", "zero"),
    *("none", "derived", "none", "no_sync", "none"),
)


def _scenario(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _Wide()
    ours, theirs = DistributedDataParallel(copy.deepcopy(base)), TorchDDP(copy.deepcopy(base))
    mismatches: list[str] = []
    kept: dict[str, list[torch.Tensor]] = {}
    flats: list[list[int]] = []
    lent_steps = 0
    for step, how in enumerate(_PATTERN):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(5, 64)
        for name, ddp in (("xgrad", ours), ("torch", theirs)):
            params = list(ddp.parameters())
            if how in ("none", "keep", "derived", "no_sync"):
                for p in params:
                    p.grad = None
            else:
                for p in params:
                    if p.grad is not None:
                        p.grad.zero_()
            if how == "no_sync":
                with ddp.no_sync():
                    ddp(x).square().sum().backward()
            ddp(x).square().sum().backward()
            if how == "keep":
                kept[name] = [p.grad for p in params]  # type: ignore[misc]
            if how == "derived":
                kept[name] = [p.grad.view(-1) for p in params]  # type: ignore[union-attr]
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            if not torch.equal(p.grad, q.grad):  # type: ignore[arg-type]
                mismatches.append(f"step {step} ({how}): {n}")
        pairs = zip(kept.get("xgrad", []), kept.get("torch", []), strict=True)
        for k, (mine, yours) in enumerate(pairs):
            if not torch.equal(mine, yours):
                mismatches.append(f"step {step} ({how}): kept gradient {k}")
        lent_steps += ours.module.a.weight.grad._base is not None  # type: ignore[union-attr]
        flats.append([b.flat.data_ptr() for b in ours.reducer._buckets])
        with torch.no_grad():
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                p -= 0.01 * p.grad  # type: ignore[operator]
                q -= 0.01 * q.grad  # type: ignore[operator]
    return {"mismatches": mismatches, "lent_steps": lent_steps, "flats": flats}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenario, 3, timeout=120)  # type: ignore[no-any-return]


def test_gradients_and_kept_gradients_equal_pytorchs(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}"


def test_views_are_lent_and_buffers_reused_when_nothing_holds_them(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        assert result["lent_steps"] >= 8  # every step whose gradients were set to None
        flats = result["flats"]
        # Step 1 rebuilt the buckets; step 2 ("none" after "none"): the lent views came
        # back, the buffers stay.
        assert flats[2] == flats[1]
        # A kept gradient (step 3) keeps its buffer: step 4 fills a fresh one.
        assert flats[4] != flats[3]
