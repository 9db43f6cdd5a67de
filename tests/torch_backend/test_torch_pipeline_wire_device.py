"""On gloo every pipeline message travels in host memory, whatever device the stages are
on: gloo's transport cannot read a CUDA pointer (a send failed with "writev: Bad address"
on a GPU machine). Each stage's wire device, an edge's, and the end-of-step exchange's
(the step's last messages, also sent on the stages' lanes) are the CPU; what lands is
moved to the stage's device."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402


def _wire(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline_edges import EdgeBook
    from xgrad.torch_backend.pipeline_route import WirePlan

    sched = xp.insert_comms(xp.make("1f1b", world, 2))
    gpu = torch.device("cuda", 0)  # where the stages are; nothing is allocated here
    book = EdgeBook(
        WirePlan.of(sched, rank), sched, rank, [dist.group.WORLD], list(range(world)), 0,
        None, 5.0, lambda stage: gpu,  # type: ignore[arg-type]
    )  # fmt: skip
    return {
        "stages": {str(book._device(s)) for s in sched.stages_of(rank)},
        "edges": {str(book._local_device(e)) for e in book.plan.peers},
        "closing": str(book.closing._device),
        "stage_device": str(book._stage_device(0)),
    }


def test_on_gloo_the_messages_of_cuda_stages_go_through_host_memory() -> None:
    for got in spawn(_wire, 2, timeout=60):
        assert got == {
            "stages": {"cpu"},
            "edges": {"cpu"},
            "closing": "cpu",
            "stage_device": "cuda:0",
        }


def _lanes(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline_lanes import open_lanes

    lanes = open_lanes(list(range(world)), 2)
    return {"group": dist.get_backend(), "lanes": [dist.get_backend(g) for g in lanes]}


def test_the_lanes_are_gloo_groups_whatever_the_pipelines_group_is() -> None:
    # A group whose backend is not plain gloo (here one per device, as NCCL users have
    # "cpu:gloo,cuda:nccl"): the lanes are gloo still, since the step's protocol needs
    # gloo's point-to-point (tags, receives completed by shorter messages).
    for got in spawn(_lanes, 2, backend="cpu:gloo,cuda:gloo", timeout=60):
        assert got == {"group": "cpu:gloo,cuda:gloo", "lanes": ["gloo", "gloo"]}
