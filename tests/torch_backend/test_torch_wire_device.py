"""Where point-to-point messages travel when the stages or tensors are on a GPU.

On gloo every pipeline message travels in host memory, whatever device the stages are
on: gloo's transport cannot read a CUDA pointer (a send failed with "writev: Bad address"
on a GPU machine). Each stage's wire device, an edge's, and the end-of-step exchange's
are the CPU; what lands is moved to the stage's device. The pipeline's lanes and
distributed autograd's messages go on gloo groups whatever the user's group is, since
their protocols need gloo's point-to-point (NCCL ignores tags and needs exact sizes).
A group with a backend per device (as NCCL users' "cpu:gloo,cuda:nccl") stands in for
NCCL here, which this machine lacks.
"""

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


def _dist_round_trip(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da
    from xgrad.torch_backend.dist_contexts import OPEN

    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    backends = set()
    for _ in range(2):  # the second context reuses the first one's twin
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 3, 1)
                roots = [(da.recv(1) * w).sum()]
            else:
                roots = []
                da.send(torch.sin(da.recv(0)) * w, 0)
            da.backward(cid, roots)
            got = da.get_gradients(cid)[w].tolist()
            backends |= {dist.get_backend(link.pg) for link in OPEN[cid].links.values()}
    return {"backends": sorted(backends), "grad": got}


def test_distributed_autograd_sends_on_a_gloo_twin_of_a_group_that_is_not_gloo() -> None:
    # On NCCL a round trip (0 to 1 to 0) would deadlock: tags are ignored there and a
    # pair's receive posted ahead holds up the send behind it. The same group kind as in
    # the lanes' test stands in for NCCL's "cpu:gloo,cuda:nccl".
    got = spawn(_dist_round_trip, 2, backend="cpu:gloo,cuda:gloo", timeout=90)
    assert [g["backends"] for g in got] == [["gloo"], ["gloo"]]
    # The whole graph in one process: sum(sin(3 w0) * w1 * w0), each rank's w a leaf.
    w0, w1 = (torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True) for _ in "01")
    want = torch.autograd.grad((torch.sin(w0 * 3) * w1 * w0).sum(), [w0, w1])
    for rank in (0, 1):
        assert got[rank]["grad"] == pytest.approx(want[rank].tolist(), rel=1e-12)
