"""Schedules whose two ranks order one edge's microbatches differently, run on real gloo
ranks (float64): xgrad's runtime gives the unpipelined model's gradients, and torch's
runtime's on the same CSV.

Rank 0 may send microbatch 1 before 0 while rank 1 runs its forward of 0 first: torch's
comm lowering posts the receives in the sender's order and its runtime runs such a CSV
with the right gradients. xgrad's validation refused both the compute-only form and
torch's lowered form ("out of order ... first in, first out"); its runtime took each
edge's messages first in, first out, and a changed description's payload (every forward
message of a first step) came on the edge's side tag in the sender's order.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
from chain import whole_gradients

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

WIDTH = 3

#: per world size: name -> compute-only CSV (rank r's row r), each pass on its rank.
CASES: dict[int, dict[str, str]] = {
    2: {
        # rank 0 sends the forwards in reverse, rank 1 takes them in order (and the
        # gradients back in order, which rank 0 takes 2, 0, 1).
        "reversed": "0F2,0F1,0F0,0B2,0B0,0B1\n1F0,1B0,1F1,1B1,1F2,1B2\n",
        # rank 0 takes gradient 1 first, rank 1 sends 0 first.
        "swap_b": "0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n",
        # two stages a rank (0, 2 on rank 0; 1, 3 on rank 1), every edge reordered.
        "chunks": ("0F1,0F0,2F1,2F0,2B1,2B0,0B1,0B0\n1F0,1F1,3F0,3I0,3F1,3I1,1B0,1B1,3W0,3W1\n"),
        # the last stage's forwards in reverse: torch's runtime keeps its losses in the
        # order of those forwards and looks them up by microbatch (it raises "Loss for
        # microbatch 2 is not available"), so this one is compared with the model alone.
        "last_reversed": "0F0,0F1,0F2,0B0,0B1,0B2\n1F2,1B2,1F1,1B1,1F0,1B0\n",
    },
    3: {
        # the probe's schedule: rank 0 sends 1 first, rank 1 takes 0 first (split backward).
        "probe": "0F1,0F0,0B0,0B1\n1F0,1B0,1F1,1I1,1W1\n2F0,2B0,2F1,2I1,2W1\n",
        # gpipe-like, the middle rank in another order, both directions.
        "middle": (
            "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n"
            "1F2,1F0,1F3,1F1,1B3,1B0,1B2,1B1\n"
            "2F0,2F1,2F2,2F3,2B1,2B0,2B3,2B2\n"
        ),
    },
}

#: cases torch's runtime does not run (see above).
NOT_TORCH = frozenset({"last_reversed"})


def _parts(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(n)]


def _batch(rows: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, WIDTH, generator=g, dtype=torch.float64)


def _gap(got: dict[int, list[Any]], want: list[list[Any]]) -> float:
    """The largest gap of ``got`` (per stage, its gradients) to ``want``'s."""
    return max(
        float((g - w).abs().max())
        for k, grads in got.items()
        for g, w in zip(grads, want[k], strict=True)
    )


def _grads(parts: list[nn.Module], mine: tuple[int, ...]) -> dict[int, list[Any]]:
    """This rank's stages' gradients, then cleared."""
    out = {k: [p.grad.clone() for p in parts[k].parameters()] for k in mine}
    for k in mine:
        parts[k].zero_grad(set_to_none=True)
    return out


def _torch_run(
    schedule: xp.Schedule, rank: int, path: str, x: Any, y: Any, run: bool
) -> tuple[dict[int, list[Any]] | None, xp.Schedule]:
    """torch's runtime on the compute-only CSV at ``path``: this rank's stages' gradients
    (None without ``run``: lowered only), and its lowering as xgrad reads it."""
    from torch.distributed.pipelining import PipelineStage, schedules

    n, m = schedule.num_stages, schedule.num_microbatches
    parts = _parts(n)
    mine = schedule.stages_of(rank)
    stages = [PipelineStage(parts[k], k, n, torch.device("cpu")) for k in mine]
    logging.disable(logging.WARNING)
    try:
        runner = schedules.ScheduleLoopedBFS(stages, m, loss_fn=nn.functional.mse_loss)
        runner._load_csv(path)
    finally:
        logging.disable(logging.NOTSET)
    runner._dump_csv(f"{path}.comms", format="compute_comms")
    if not run:
        return None, xp.load_csv(f"{path}.comms")
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    runner.step(*((x,) if first else ()), **({"target": y} if last else {}))
    return _grads(parts, mine), xp.load_csv(f"{path}.comms")


def _run(rank: int, world: int, root: str) -> dict[str, float]:
    from xgrad.torch_backend import pipeline_frame
    from xgrad.torch_backend.pipeline import PipelineRuntime

    packed = pipeline_frame.PACK_LIMIT
    out: dict[str, float] = {}
    for name, text in CASES[world].items():
        path = os.path.join(root, f"{name}.{rank}.csv")
        with open(path, "w") as f:
            f.write(text)
        schedule = xp.load_csv(path)
        n, m = schedule.num_stages, schedule.num_microbatches
        mine = schedule.stages_of(rank)
        first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
        x, y = _batch(2 * m, 1)
        theirs, lowered = _torch_run(schedule, rank, path, x, y, name not in NOT_TORCH)
        parts = _parts(n)
        want = whole_gradients(parts, x, y)
        if theirs is not None:
            out[f"{name}/torch"] = _gap(theirs, want)
        for form, sched in (
            ("compute", schedule),
            ("apart", schedule),
            ("xgrad_comms", xp.insert_comms(xp.add_stage_ops(schedule))),
            ("torch_comms", lowered),
        ):
            # "apart": every message's leaves in receives of their own, after the header's.
            pipeline_frame.PACK_LIMIT = 0 if form == "apart" else packed
            rt = PipelineRuntime(sched, [parts[k] for k in mine], nn.MSELoss(), timeout=30)
            # Steps of 2m, 2m, 3m rows: the first and third send new descriptions (on
            # the side tags), the second the ones the receivers posted for.
            for i, rows in enumerate((2 * m, 2 * m, 3 * m)):
                bx, by = (x, y) if i == 0 else _batch(rows, 2 + i)
                rt.step(bx if first else None, by if last else None)
                got = _grads(parts, mine)
                out[f"{name}/{form}/{i}"] = _gap(got, whole_gradients(parts, bx, by))
                if i == 0 and theirs is not None:
                    # ... and torch's runtime's, on the same CSV and batch.
                    out[f"{name}/{form}/torch"] = _gap(got, [theirs.get(k, []) for k in range(n)])
            if form == "compute":
                # eval runs the forwards alone, in each rank's order: the model's outputs.
                got_out = rt.eval(x if first else None)
                if last:
                    with torch.no_grad():
                        whole = x
                        for part in parts:
                            whole = part(whole)
                    out[f"{name}/eval"] = float((got_out - whole).abs().max())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reordered_edges_give_the_unpipelined_gradients(world: int, tmp_path: Any) -> None:
    results = spawn(_run, world, args=(str(tmp_path),), timeout=120)
    for rank, res in enumerate(results):
        ran = {k.split("/")[0] for k in res}
        assert ran == set(CASES[world]), (rank, sorted(res))
        assert sum(k.endswith("torch") for k in res) == 5 * len(ran - NOT_TORCH), sorted(res)
        # the last stage is on the last rank in every case: its eval's outputs.
        assert (rank == world - 1) == all(f"{c}/eval" in res for c in CASES[world]), rank
        for key, gap in res.items():
            assert gap <= 1e-12, (rank, key, gap)
