"""Actions: the text form round-trips and bad text is refused with the text shown."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xgrad.pipeline import Action, Kind


def test_text_form_literal() -> None:
    assert str(Action(1, Kind.FORWARD, 0)) == "1F0"
    assert str(Action(12, Kind.SEND_B, 3)) == "12SEND_B3"
    assert Action.parse("2W7") == Action(2, Kind.BACKWARD_WEIGHT, 7)
    assert Action.parse(" 0RECV_F10 ") == Action(0, Kind.RECV_F, 10)


@given(st.integers(0, 999), st.sampled_from(list(Kind)), st.integers(0, 999))
def test_text_form_round_trips(stage: int, kind: Kind, microbatch: int) -> None:
    a = Action(stage, kind, microbatch)
    assert Action.parse(str(a)) == a


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
    }
    assert all(k.is_comm for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B))
