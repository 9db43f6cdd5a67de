"""Actions: the text form round-trips and bad text is refused with the text shown."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xgrad.pipeline import NO_MICROBATCH, Action, Kind, expand


def test_text_form_literal() -> None:
    assert str(Action(1, Kind.FORWARD, 0)) == "1F0"
    assert str(Action(12, Kind.SEND_B, 3)) == "12SEND_B3"
    assert Action.parse("2W7") == Action(2, Kind.BACKWARD_WEIGHT, 7)
    assert Action.parse(" 0RECV_F10 ") == Action(0, Kind.RECV_F, 10)


_PER_MICROBATCH = [k for k in Kind if not k.is_stage_op and k is not Kind.OVERLAP_F_B]


@given(st.integers(0, 999), st.sampled_from(_PER_MICROBATCH), st.integers(0, 999))
def test_text_form_round_trips(stage: int, kind: Kind, microbatch: int) -> None:
    a = Action(stage, kind, microbatch)
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("kind", [Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD])
def test_stage_level_actions_have_no_microbatch(kind: Kind) -> None:
    a = Action.stage_op(3, kind)
    assert str(a) == f"3{kind.value}" and a.microbatch == NO_MICROBATCH
    assert Action.parse(f"3{kind.value}") == a
    assert kind.is_stage_op and not kind.is_compute and not kind.is_comm
    with pytest.raises(ValueError, match="UNSHARD, RESHARD or REDUCE_GRAD"):
        Action.stage_op(0, Kind.FORWARD)


def test_overlapped_pair_as_torch_writes_it() -> None:
    a = Action.parse("(0F3;3B1)OVERLAP_F_B")
    assert a.kind is Kind.OVERLAP_F_B and a.sub == (Action.parse("0F3"), Action.parse("3B1"))
    assert str(a) == "(0F3;3B1)OVERLAP_F_B"
    assert list(expand([Action.parse("1F0"), a])) == [
        Action.parse("1F0"),
        Action.parse("0F3"),
        Action.parse("3B1"),
    ]
    with pytest.raises(ValueError, match="a forward and a backward"):
        Action.parse("(0B3;3F1)OVERLAP_F_B")
    with pytest.raises(ValueError, match="two actions"):
        Action.parse("(0F3)OVERLAP_F_B")


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "1SEND0", "-1F0", "1F0x"])
def test_bad_text_names_it(text: str) -> None:
    with pytest.raises(ValueError, match="action text"):
        Action.parse(text)


def test_non_string_is_type_error() -> None:
    with pytest.raises(TypeError, match="3"):
        Action.parse(3)  # type: ignore[arg-type]


def test_compute_and_comm_kinds() -> None:
    assert {k for k in Kind if k.is_compute} == {
        Kind.FORWARD,
        Kind.BACKWARD,
        Kind.BACKWARD_INPUT,
        Kind.BACKWARD_WEIGHT,
        Kind.OVERLAP_F_B,
    }
    assert all(k.is_comm for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B))
