"""The gradient of the step's own input batch, when it requires grad, under every schedule.

An input that requires grad (an adversarial example, a penalty on the input) got the whole
model's gradient under GPipe and 1F1B, but ``None`` under the split-backward schedules
(ZB-H1, ZB-H2, interleaved ZB, ZBV), and only the microbatches that DualPipeV ran with a full
B under it (the others stayed zero), without a word: the first stage's I pass has nothing
of the stage's to differentiate, and its W pass took the parameters only. On two gloo
ranks, against the whole model in one process, in every checkpoint mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import tanh_stages as ts
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

SCHEDULES = ("gpipe", "zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev")


def _run(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        _, mine, rt = ts.runtime(name, rank, checkpoint=checkpoint, timeout=20)
        x, y = ts.data()
        x.requires_grad_()
        rt.step(x, y)
        if 0 in mine:
            out[name] = x.grad
    return out


def _whole(n: int) -> torch.Tensor:
    """The input's gradient through the ``n`` stages run as one model."""
    x, y = ts.data()
    x.requires_grad_()
    h = x
    for stage in ts.stages(n):
        h = stage(h)
    nn.functional.mse_loss(h, y).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_input_batch_gets_the_whole_models_gradient(checkpoint: str) -> None:
    results = spawn(_run, 2, args=(checkpoint,), timeout=120)
    assert sorted(results[0]) == sorted(SCHEDULES)  # rank 0 holds stage 0 in each
    for name in SCHEDULES:
        got = results[0][name]
        assert got is not None, name
        want = _whole(ts.schedule(name).num_stages)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=name)


def _upstream(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"):
        _, mine, rt = ts.runtime(name, rank, timeout=20)
        x, y = ts.data()
        base = x.clone().requires_grad_()
        scale = torch.full((ts.WIDTH,), 1.5, dtype=torch.float64, requires_grad=True)
        rt.step(base * scale, y)  # the batch has a graph of its own upstream
        if 0 in mine:
            out[name] = (base.grad, scale.grad)
    return out


def test_a_batch_with_a_graph_upstream_gets_its_gradient_under_every_schedule() -> None:
    """The microbatches share the batch's upstream graph (``base * scale``): the first
    microbatch's backward freed it, and the second raised "backward through the graph a
    second time" (under GPipe and 1F1B too)."""
    results = spawn(_upstream, 2, timeout=120)
    assert len(results[0]) == 5  # rank 0 holds stage 0 in each
    for name, (base_grad, scale_grad) in results[0].items():
        n = ts.schedule(name).num_stages
        x, y = ts.data()
        base = x.clone().requires_grad_()
        scale = torch.full((ts.WIDTH,), 1.5, dtype=torch.float64, requires_grad=True)
        h = base * scale
        for stage in ts.stages(n):
            h = stage(h)
        nn.functional.mse_loss(h, y).backward()
        torch.testing.assert_close(base_grad, base.grad, rtol=1e-12, atol=1e-15, msg=name)
        torch.testing.assert_close(scale_grad, scale.grad, rtol=1e-12, atol=1e-15, msg=name)
