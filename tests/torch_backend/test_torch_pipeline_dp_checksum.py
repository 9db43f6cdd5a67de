"""A replica's batch read as a weight is refused even where its words sum alike
(``pipeline_checksum``).

Under ``dp_group``, a tensor that a stage or its loss reads of its own and that the step
was not given on that rank is taken as a weight, and ``pipeline_average`` refuses one whose
values differ between the replicas (a replica's batch, read by the loss on a rank not
given it) rather than average it. The values were compared by the plain sum of their
32-bit words, blind to where each word is: replicas whose batches are one-hot rows of
other classes, the same rows in another order, or columns doubled and halved (an
exponent up, another down) summed alike, and their batches' gradients were averaged.

One spawn of four gloo ranks: two replicas of a two-rank 1F1B pipeline (pipelines {0, 1}
and {2, 3}, ``dp_group`` {0, 2} and {1, 3}); the loss on ranks 1 and 3 closes over the
batch, given on ranks 0 and 2 alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

#: how the second replica's batch differs from the first's while its words sum alike
KINDS = ("one-hot", "rows reordered", "doubled and halved")


def _batch(kind: str, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    if kind == "one-hot":  # one 1.0 a row, another class on each replica
        classes = torch.randint(0, 4, (6,), generator=g)
        x = nn.functional.one_hot((classes + replica) % 4, 4).double()
    else:
        x = torch.randn(6, 4, generator=g, dtype=torch.float64).add(3.0)  # (no zeros)
        if replica and kind == "rows reordered":
            x = x.flip(0)
        if replica and kind == "doubled and halved":
            x = x * torch.tensor([2.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    return x.requires_grad_()


def _replica(rank: int, pipes: list[Any], dps: list[Any], kind: str) -> str:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    replica, mine = divmod(rank, 2)
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x = _batch(kind, replica)
    t = torch.randn(6, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y, target) + 0.1 * (y.mean() * x).pow(2).mean()

    schedule = xp.make("1f1b", 2, 3)
    rt = PipelineRuntime(
        schedule, [lin], loss, group=pipes[replica], dp_group=dps[mine], timeout=10
    )
    try:
        rt.step(x if mine == 0 else None, t if mine == 1 else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "averaged"


def _run(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {kind: _replica(rank, pipes, dps, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return spawn(_run, 4, timeout=60)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_whose_words_sum_alike_is_refused(results: list[dict[str, str]], kind: str) -> None:
    for rank in range(4):
        got = results[rank][kind]
        assert "differ between the data-parallel replicas ((6, 4) torch.float64)" in got, (
            rank,
            got,
        )


def test_the_checksum_reads_values_not_layout() -> None:
    """Equal values give equal checksums whatever their strides, offset or dtype's size
    (the last bytes of an odd float32 or float16 tensor included); one bit changed
    anywhere changes it."""
    from xgrad.torch_backend.pipeline_checksum import checksums

    y = torch.randn(5, 2100)
    assert checksums([y.t().contiguous().t(), y[1:]]) == checksums([y, y[1:].clone()])
    for t in (torch.randn(()), torch.randn(3, dtype=torch.float16), torch.randn(2047)):
        assert checksums([t]) == checksums([t.clone()])
    assert checksums([torch.zeros(0)]) == [0]
    base = torch.randn(3 * 1021 + 3)  # rows, the words after them, and 4 bytes more
    first = checksums([base])[0]
    for i in range(0, base.numel(), 13):
        flipped = base.clone()
        flipped.view(torch.int32)[i] ^= 1
        assert checksums([flipped])[0] != first, i
