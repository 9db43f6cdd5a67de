"""CSV: round trips, and the same format as torch.distributed.pipelining reads and writes."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import xgrad.pipeline as xp


@pytest.mark.parametrize("name", sorted(xp.SCHEDULES))
@pytest.mark.parametrize("comms", [False, True])
def test_round_trip(name: str, comms: bool, tmp_path: Path) -> None:
    s = xp.make(name, 2, 4)
    s = xp.insert_comms(xp.add_stage_ops(s)) if comms else s
    xp.dump_csv(s, tmp_path / "s.csv")
    back = xp.load_csv(tmp_path / "s.csv")
    assert back.actions == s.actions and back.placement == s.placement
    assert back.num_microbatches == 4


def test_literal_text_and_idle_cells() -> None:
    assert xp.schedule_to_csv(xp.one_f_one_b(2, 1)) == "0F0,0B0\r\n1F0,1B0\r\n"
    # torch writes idle steps (None) as empty cells.
    s = xp.schedule_from_csv("0F0,,0B0\n,1F0,1B0\n")
    assert [[str(a) for a in acts] for acts in s.actions] == [["0F0", "0B0"], ["1F0", "1B0"]]


def test_bad_cells_and_placement() -> None:
    with pytest.raises(ValueError, match="rank 1, column 0"):
        xp.schedule_from_csv("0F0,0B0\n1Q0\n")
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        xp.schedule_from_csv("0F0\n0B0\n")
    with pytest.raises(ValueError, match=r"stages \[1\]"):
        xp.schedule_from_csv("0F0,2F0\n")
    with pytest.raises(ValueError, match="no actions"):
        xp.schedule_from_csv("\n")


def test_a_huge_stage_number_is_named_without_listing_every_stage_below() -> None:
    # Every stage below the largest was listed (a 7.9 MB message at 10**6; memory
    # exhausted at 10**8).
    for stage in (10**6, 10**11):
        with pytest.raises(ValueError) as err:
            xp.schedule_from_csv(f"0F0,{stage}F0\n")
        assert len(str(err.value)) < 300
        assert f"highest stage named is {stage}" in str(err.value)
        assert f"(and {stage - 11} more)" in str(err.value)


def test_torch_reads_our_actions_and_we_read_its_comm_pass() -> None:
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    s = xp.interleaved_1f1b(2, 4, chunks=2)
    text = xp.schedule_to_csv(s)
    rows = [line.split(",") for line in text.strip().splitlines()]
    order = {r: [torch_schedules._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    assert [[str(a) for a in acts] for acts in order.values()] == rows
    # torch's own validator accepts the schedule and finds the same placement.
    mapping = torch_schedules._validate_schedule(order, 2, 4, 4)
    assert tuple(mapping[i] for i in range(4)) == s.placement
    # torch's own send/recv pass; the result passes our validator.
    with_comms = torch_schedules._add_send_recv(order, lambda i: s.placement[i], 4)
    text = "\n".join(",".join(str(a) for a in with_comms[r]) for r in sorted(with_comms))
    theirs = xp.schedule_from_csv(text)
    xp.validate(theirs, rendezvous=False)
    assert xp.strip_comms(theirs).actions == s.actions


def test_comms_without_reduce_grad_warn_that_torch_would_not_scale() -> None:
    """torch's runtime runs a file with comms as it is, and only its REDUCE_GRAD scales the
    gradients by 1/m: an xgrad schedule with comms but no stage ops gave m times the
    gradients there (and the right ones on xgrad's runtime), without a word."""
    bare = xp.insert_comms(xp.make("1f1b", 2, 4))
    with pytest.warns(UserWarning, match=r"no REDUCE_GRAD.*1/m \(m = 4\).*add_stage_ops") as got:
        xp.schedule_to_csv(bare)
    assert got[0].filename == __file__  # named at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xp.schedule_to_csv(xp.make("1f1b", 2, 4))  # compute only: torch lowers it itself
        text = xp.schedule_to_csv(xp.insert_comms(xp.add_stage_ops(xp.make("1f1b", 2, 4))))
    assert "REDUCE_GRAD" in text
