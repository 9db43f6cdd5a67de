"""Reports as data: verdicts within a tolerance, signatures and digests."""

from __future__ import annotations

import pytest

from xgrad.experiments.report import Panel, Report, Series, Table, within


def _report(rows: tuple[tuple[object, ...], ...], title: str = "t") -> Report:
    return Report(
        name="x",
        title=title,
        link="none",
        backend="reference",
        config={"a": 1},
        tables=(Table("main", ("k", "v"), rows, deterministic=True),),
        panels=(Panel(title, "k", "v", (Series(f"s{len(rows)}", (0.0,), (1.0,)),)),),
        verdicts=(within("claim", "paper", 1.0, 1.1, rel_tol=0.15),),
    )


def test_within_agrees_inside_the_tolerance_and_says_why_not_outside() -> None:
    ok = within("c", "s", 2.0, 2.2, rel_tol=0.15, why="w", why_not="n")
    assert ok.agrees and ok.word == "agrees" and "+10.0%" in ok.by and ok.why == "w"
    bad = within("c", "s", 2.0, 3.0, rel_tol=0.15, why="w", why_not="n")
    assert not bad.agrees and bad.word == "disagrees" and bad.why == "w n"
    zero = within("c", "s", 0.0, 0.001, rel_tol=0.01)
    assert zero.agrees and "absolute" in zero.by


def test_signature_ignores_numbers_and_digest_sees_them() -> None:
    a, b = _report(((1, 2.0),)), _report(((1, 2.0), (2, 3.0)), title="other")
    assert a.signature() == b.signature()
    assert a.deterministic_digest() != b.deterministic_digest()
    assert a.deterministic_digest() == _report(((1, 2.0),)).deterministic_digest()
    doc = a.to_dict()
    assert doc["verdicts"][0]["verdict"] == "agrees" and doc["signature"] == a.signature()


def test_rows_must_fit_the_columns() -> None:
    with pytest.raises(ValueError, match="has 1 values for 2 columns"):
        Table("t", ("a", "b"), ((1,),))
