"""Multi-stage schedules give torch.distributed.pipelining's per-rank order, (p, m, v) alike.

torch's schedule classes build their ``pipeline_order`` for every rank in the constructor;
stand-in stage objects (group size, rank, stage count) are all they read to do it, so no
process group is needed.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

import xgrad.pipeline as xp

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

TORCH_CLASSES = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_schedule(name: str, p: int, m: int, v: int) -> Any:
    stages = [
        types.SimpleNamespace(
            group_size=p, group_rank=0, num_stages=p * v, stage_index=k, submod=None
        )
        for k in range(v)
    ]
    logging.disable(logging.WARNING)
    try:
        return getattr(schedules, TORCH_CLASSES[name])(stages, m)
    finally:
        logging.disable(logging.NOTSET)


def torch_order(name: str, p: int, m: int, v: int) -> list[list[str]]:
    order = torch_schedule(name, p, m, v).pipeline_order
    return [[str(a) for a in order[r] if a is not None] for r in range(p)]


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in TORCH_CLASSES:
        for p in (1, 2, 3, 4):
            for m in range(1, 13):
                for v in (2,) if name in ("zbv", "dualpipev") else (1, 2, 3):
                    cases.append((name, p, m, v))
    return cases


def test_same_order_as_torch_or_both_refuse() -> None:
    compared = refused = 0
    for name, p, m, v in _grid():
        try:
            theirs: list[list[str]] | None = torch_order(name, p, m, v)
        except ValueError:
            theirs = None
        if theirs is None:
            with pytest.raises(ValueError):
                xp.make(name, p, m, chunks=v)
            refused += 1
            continue
        ours = xp.make(name, p, m, chunks=v)
        assert [[str(a) for a in acts] for acts in ours.actions] == theirs, (name, p, m, v)
        xp.validate(xp.insert_comms(ours))
        compared += 1
    # m = 10 for p = 4 and m < p are among the compared (torch accepts them).
    assert compared > 300 and refused > 20


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
def test_torch_dump_csv_reads_back_runs_and_writes_the_same(name: str, tmp_path: Any) -> None:
    p, m = 2, 4
    path = tmp_path / f"{name}.csv"
    torch_schedule(name, p, m, 2)._dump_csv(str(path))  # with comms, UNSHARD, REDUCE_GRAD...
    text = path.read_text()
    assert "UNSHARD" in text and "REDUCE_GRAD" in text
    theirs = xp.load_csv(path)
    xp.validate(theirs, rendezvous=False)  # torch's own lowering: buffered sends
    assert xp.strip_comms(theirs).actions == xp.make(name, p, m).actions
    assert xp.schedule_to_csv(theirs).splitlines() == text.splitlines()


def test_dualpipev_has_overlapped_pairs_and_mixes_b_with_i_w() -> None:
    s = xp.dualpipev(2, 4)
    kinds = {a.kind for a in s.actions[0]}
    assert (
        xp.Kind.OVERLAP_F_B in kinds
        and xp.Kind.BACKWARD in kinds
        and xp.Kind.BACKWARD_INPUT in kinds
    )
    # Each microbatch of a stage is B, or I and W, never both.
    xp.validate(s)
    assert s.backward_kind(0, 3) is xp.Kind.BACKWARD_INPUT
    assert s.backward_kind(3, 1) is xp.Kind.BACKWARD


def test_1f1b_follows_what_torch_runs_not_its_listed_order() -> None:
    """torch's ``Schedule1F1B._get_pipeline_order`` lists the last rank as F1 B0 F2 B1 ...
    F(m) B(m-1): it skips F0 and names a microbatch m that does not exist. Its runtime
    (``_step_microbatches``: p - r warm-up forwards, then B and F alternate) runs F0 B0 F1
    B1 ...; xgrad follows the runtime. The other ranks agree with the listed order."""
    p, m = 3, 4
    stage = types.SimpleNamespace(
        group_size=p, group_rank=0, num_stages=p, stage_index=0, submod=None
    )
    logging.disable(logging.WARNING)
    try:
        listed = schedules.Schedule1F1B(stage, m)._get_pipeline_order()
    finally:
        logging.disable(logging.NOTSET)
    theirs = [
        [str(a) for a in listed[r] if a is not None and "REDUCE" not in str(a)] for r in range(p)
    ]
    ours = [[str(a) for a in acts] for acts in xp.one_f_one_b(p, m).actions]
    assert ours[:-1] == theirs[:-1]
    assert theirs[-1] == ["2F1", "2B0", "2F2", "2B1", "2F3", "2B2", "2F4", "2B3"]  # listed
    assert ours[-1] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]  # executed


def test_stage_ops_and_comms_are_torch_lowering_even_with_four_stages_a_rank() -> None:
    """``insert_comms(add_stage_ops(...))`` is torch's ``pipeline_order_with_comms``,
    rank by rank. Torch keeps 3 stages unsharded at once: with 4 or 5 on a rank, a stage
    is resharded and unsharded again between its passes (xgrad used to unshard all at
    the start and reshard each after its last backward)."""
    compared = 0
    for name in TORCH_CLASSES:
        for p in (2, 3):
            for m in (2, 3, 4, 6):
                for v in (2,) if name in ("zbv", "dualpipev") else (1, 2, 4, 5):
                    try:
                        theirs = torch_schedule(name, p, m, v).pipeline_order_with_comms
                    except ValueError:
                        continue
                    ours = xp.insert_comms(xp.add_stage_ops(xp.make(name, p, m, chunks=v)))
                    for r in range(p):
                        assert [str(a) for a in ours.actions[r]] == [str(a) for a in theirs[r]], (
                            name,
                            p,
                            m,
                            v,
                            r,
                        )
                    compared += 1
    assert compared > 60
    s = xp.add_stage_ops(xp.make("interleaved_1f1b", 2, 2, chunks=4))
    assert [str(a) for a in s.actions[0][:7]] == [
        "0UNSHARD",
        "2UNSHARD",
        "4UNSHARD",
        "0F0",
        "0F1",
        "0RESHARD",
        "6UNSHARD",
    ]
    with pytest.raises(ValueError, match="max_active_stages must be an int >= 1, got 0"):
        xp.add_stage_ops(xp.gpipe(2, 2), max_active_stages=0)
