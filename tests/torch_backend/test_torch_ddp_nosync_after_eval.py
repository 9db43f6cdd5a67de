"""``no_sync`` accumulation after a forward pass every rank left without a backward, on gloo.

A validation loss computed in train mode with gradients on (legal) leaves PyTorch's reducer
prepared: the next backward pass, a ``no_sync`` one included, is reduced and finalized,
later ``no_sync`` passes stay local, and the synchronised pass reduces what they
accumulated. xgrad's reducer took that first ``no_sync`` pass's gradients, launched them,
never finalized, and the synchronised pass raised DDP's "prior iteration" error on every
rank. The gradients after every backward pass must be PyTorch's bit for bit: 1 to 3
micro-batches, with ``find_unused_parameters``, gradients as bucket views and a static
graph, the forward pass in the first iteration or after a step. The same forward pass on
one rank only, its peer reducing, still fails that step on both ranks, and the steps
after it give the full batch's gradients; so does a forward pass raising in the reduced
``no_sync`` pass.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from ranks import run_ranks

from xgrad.torch_backend.spawn import spawn

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
OPTIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "find_unused": {"find_unused_parameters": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
}


def _run(rank: int, cls: Any, options: dict[str, bool], k: int, first: bool) -> list[Any]:
    """A step (unless ``first``), a forward pass without backward, two steps of ``k``
    ``no_sync`` micro-batches and a synchronised one; ``.grad`` after every backward."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    ddp = cls(model, **options)
    g = torch.Generator().manual_seed(7 + rank)
    out: list[Any] = []

    def backward(sync: bool = True) -> None:
        x = torch.randn(4, 5, generator=g)
        if sync:
            ddp(x).pow(2).mean().backward()
        else:
            with ddp.no_sync():
                ddp(x).pow(2).mean().backward()
        out.append([p.grad.clone() for p in model.parameters()])

    steps = ([] if first else ["step"]) + ["eval", "accumulate", "accumulate"]
    for step in steps:
        model.zero_grad(set_to_none=True)
        try:
            if step == "step":
                backward()
            elif step == "eval":
                ddp(torch.randn(4, 5, generator=g)).pow(2).mean()  # no backward, on every rank
            else:
                for _ in range(k):
                    backward(sync=False)
                backward()
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    return out


def _compare(rank: int, world: int) -> dict[str, Any]:
    import warnings

    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    warnings.simplefilter("ignore")  # find_unused_parameters with none unused
    same: dict[str, Any] = {}
    for name, options in OPTIONS.items():
        for first in (False, True):
            for k in (1, 2, 3):
                theirs = _run(rank, TorchDDP, options, k, first)
                ours = _run(rank, DistributedDataParallel, options, k, first)
                key = f"{name}-{'first' if first else 'later'}-{k}"
                same[key] = _same(theirs, ours, torch.equal)
    return same


def _same(theirs: list[Any], ours: list[Any], equal: Any) -> Any:
    """True, or what the runs did instead: their errors, or where the gradients differ."""
    errors = [x for x in (*theirs, *ours) if isinstance(x, str)]
    if errors or len(theirs) != len(ours):
        return errors or f"{len(theirs)} backward passes against {len(ours)}"
    differ = [
        i
        for i, (t, o) in enumerate(zip(theirs, ours, strict=True))
        if not all(equal(a, b) for a, b in zip(t, o, strict=True))
    ]
    return not differ or f"gradients differ after backward passes {differ}"


@pytest.fixture(scope="module")
def compared() -> list[dict[str, Any]]:
    return spawn(_compare, 2, timeout=240)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("first", [False, True], ids=["later", "first"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gradients_equal_pytorchs_after_every_backward(
    compared: list[dict[str, Any]], options: str, first: bool, k: int
) -> None:
    key = f"{options}-{'first' if first else 'later'}-{k}"
    assert all(compared[rank][key] is True for rank in range(2)), [r[key] for r in compared]


def _one_rank_skips(rank: int, world: int, what: str) -> dict[str, Any]:
    """Step 1: rank 1 runs a forward pass without backward while rank 0 reduces
    (``skip``), or every rank does and rank 1's first ``no_sync`` forward then raises
    (``raise``); steps 2 and 3 accumulate two micro-batches before the synchronised one."""
    import warnings

    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 8, 5, generator=g)  # three micro-batches of 8 rows (4 per rank)
    ref = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    ref.load_state_dict(model.state_dict())
    for i in range(3):
        ref(x[i]).pow(2).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    xs = x[:, rank * 4 : (rank + 1) * 4]
    ddp = DistributedDataParallel(model, timeout=10.0)
    bad = {"on": False}

    def pre(module: Any, inputs: Any) -> None:
        if bad["on"]:
            bad["on"] = False
            raise ValueError("bad batch")

    model[0].register_forward_pre_hook(pre)
    out: dict[str, Any] = {"steps": []}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(4):
            model.zero_grad(set_to_none=True)
            try:
                if step == 1:
                    loss = ddp(xs[0]).pow(2).mean()
                    if what == "skip" and rank == 0:
                        loss.backward()
                    out["steps"].append("no error")
                    continue
                for i in range(2):
                    bad["on"] = what == "raise" and step == 2 and rank == 1 and i == 0
                    with ddp.no_sync():
                        ddp(xs[i]).pow(2).mean().backward()
                ddp(xs[2]).pow(2).mean().backward()
                out["steps"].append(
                    max(
                        float((p.grad - w).abs().max())
                        for p, w in zip(model.parameters(), want, strict=True)
                    )
                )
            except Exception as exc:
                out["steps"].append(f"{type(exc).__name__}: {exc}")
    out["warnings"] = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    return out


def test_a_forward_without_backward_on_one_rank_still_fails_its_step_on_both() -> None:
    results, codes = run_ranks(_one_rank_skips, 2, args=("skip",), timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    (s0, r0), (s1, r1) = results[0], results[1]
    assert s0 == s1 == "ok", results
    assert "rank 1" in r0["steps"][1] and "never reached DDP" in r0["steps"][1], r0
    assert r1["steps"][1] == "no error" and any("never reached DDP" in w for w in r1["warnings"])
    for r in (r0, r1):  # then the ranks are in step again: the full batch's gradients
        assert all(isinstance(e, float) and e < 1e-6 for e in (r["steps"][0], *r["steps"][2:]))


def test_a_forward_raising_in_the_reduced_nosync_pass_fails_that_step_on_both() -> None:
    results, codes = run_ranks(_one_rank_skips, 2, args=("raise",), timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    (s0, r0), (s1, r1) = results[0], results[1]
    assert s0 == s1 == "ok", results
    for r in (r0, r1):
        assert "rank 1" in r["steps"][2] and "bad batch" in r["steps"][2], r
        assert all(isinstance(e, float) and e < 1e-6 for e in (r["steps"][0], r["steps"][3]))
