"""Simulator: the published bubble and memory figures, over a grid of p and m."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Kind

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble_and_memory(p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    g = xp.simulate(xp.gpipe(p, m))
    o = xp.simulate(xp.one_f_one_b(p, m))
    assert g.bubble_fraction == pytest.approx(want, abs=1e-12)
    assert o.bubble_fraction == pytest.approx(want, abs=1e-12)
    assert g.peak_held == (m,) * p
    assert max(o.peak_held) == min(p, m)
    assert o.peak_held == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    o = xp.simulate(xp.one_f_one_b(p, m))
    z = xp.simulate(xp.zb_h1(p, m))
    # Idle time per rank: 1F1B (p-1)(F+B) = 3(p-1) units, ZB-H1 p-1.
    assert o.step_time - o.busy[0] == pytest.approx(3 * (p - 1))
    assert z.step_time - z.busy[0] == pytest.approx(p - 1)
    assert z.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(z.peak_held) == p


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h2_about_zero_bubble(p: int, m: int) -> None:
    z2 = xp.simulate(xp.zb_h2(p, m))
    z1 = xp.simulate(xp.zb_h1(p, m))
    if m >= 2 * p - 1:
        assert z2.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert z2.bubble_fraction <= z1.bubble_fraction + 1e-12
    assert max(z2.peak_held) == min(2 * p - 1, m)


@pytest.mark.parametrize(
    ("p", "k", "v"), [(p, k, v) for p in (2, 3, 4) for k in (1, 2, 3) for v in (1, 2, 3)]
)
def test_interleaved_bubble_is_1_over_v(p: int, k: int, v: int) -> None:
    m = k * p
    s = xp.interleaved_1f1b(p, m, chunks=v)
    assert xp.simulate(s).bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    # A chunk costs 1/v of a whole stage: the idle time is 1/v of 1F1B's.
    chunk = {Kind.FORWARD: 1 / v, Kind.BACKWARD: 2 / v}
    it = xp.simulate(s, chunk)
    o = xp.simulate(xp.one_f_one_b(p, m))
    assert it.step_time - it.busy[0] == pytest.approx((o.step_time - o.busy[0]) / v)


def test_literal_timeline() -> None:
    sim = xp.simulate(xp.one_f_one_b(2, 2))
    got = [[(str(s.action), s.start, s.end) for s in spans] for spans in sim.spans]
    assert got == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)],
        [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)],
    ]
    assert sim.makespan == sim.step_time == 9
    assert sim.busy == (6, 6)
    assert "bubble fraction (of total time): 0.3333" in sim.summary()


def test_grid_literal() -> None:
    sim = xp.simulate(xp.gpipe(2, 1))
    assert sim.grid() == (
        "     rank 0  rank 1\n"
        "t 0: 0F0\n"
        "t 1:         1F0\n"
        "t 2:         1B0\n"
        "t 3:         1B0\n"
        "t 4: 0B0\n"
        "t 5: 0B0\n"
    )


def test_measured_costs_and_comm_latency() -> None:
    s = xp.one_f_one_b(2, 2)
    costs = {
        (0, Kind.FORWARD): 1.0,
        (1, Kind.FORWARD): 3.0,
        (0, Kind.BACKWARD): 2.0,
        (1, Kind.BACKWARD): 1.0,
    }
    sim = xp.simulate(s, lambda a: costs[(a.stage, a.kind)], comm_cost=0.5)
    ends = {str(sp.action): sp.end for spans in sim.spans for sp in spans}
    assert ends["1F0"] == 1 + 0.5 + 3
    assert ends["0B0"] == ends["1B0"] + 0.5 + 2


def test_missing_cost_and_negative_cost() -> None:
    with pytest.raises(ValueError, match="BACKWARD"):
        xp.simulate(xp.gpipe(2, 2), {Kind.FORWARD: 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        xp.simulate(xp.gpipe(2, 2), lambda a: -1.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_impossible_costs_are_refused_by_name(bad: float) -> None:
    """A negative or NaN comm_cost let 1F0 start before 0F0 ended; NaN and infinite costs
    gave a NaN step time or bubble fraction."""
    s = xp.one_f_one_b(2, 2)
    with pytest.raises(ValueError, match=f"comm_cost must be >= 0 and finite, got {bad!r}"):
        xp.simulate(s, comm_cost=bad)
    with pytest.raises(
        ValueError, match=f"costs\\[FORWARD\\] must be >= 0 and finite, got {bad!r}"
    ):
        xp.simulate(s, {Kind.FORWARD: bad, Kind.BACKWARD: 2.0})
    with pytest.raises(ValueError, match=f"costs\\(1B0\\) must be >= 0 and finite, got {bad!r}"):
        xp.simulate(s, lambda a: bad if str(a) == "1B0" else 1.0)


def test_zero_costs_give_a_zero_step_and_a_clear_grid_error() -> None:
    sim = xp.simulate(xp.one_f_one_b(2, 2), {Kind.FORWARD: 0, Kind.BACKWARD: 0})
    assert (sim.step_time, sim.makespan, sim.bubble_fraction) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="every one of the 8 actions takes 0 time"):
        sim.grid()
    # Some free actions among timed ones: the grid is drawn in the timed ones' quantum,
    # and a free action shares its row with the next (1F0 was drawn over by 1B0).
    part = xp.simulate(xp.gpipe(2, 1), {Kind.FORWARD: 0, Kind.BACKWARD: 1})
    assert part.grid() == "     rank 0  rank 1 \nt 0: 0F0     1F0/1B0\nt 1: 0B0\n"


def test_the_timeline_grid_shows_every_action_whatever_the_costs() -> None:
    """With F = 1 and B = 1.5 the rows were a unit long, and an action that started
    mid-row was drawn over by the next: 1F1B p = 2, m = 5 lost 0F3 and 1F1 from the
    picture. Rows are half a unit now; a quantum that fits no row boundary puts the
    actions that share a row in it together."""
    sim = xp.simulate(xp.one_f_one_b(2, 5), {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.5})
    rows = sim.grid().splitlines()[1:]
    assert len(rows) == round(sim.makespan / 0.5) == 30
    assert rows[:7] == [
        "t 00: 0F0",
        "t 01: 0F0",
        "t 02: 0F1     1F0",
        "t 03: 0F1     1F0",
        "t 04:         1B0",
        "t 05:         1B0",
        "t 06:         1B0",
    ]
    for quantum in (None, 1.0, 0.7):
        cells = {
            label
            for row in sim.grid(quantum).splitlines()[1:]
            for cell in row.split(":", 1)[1].split()
            for label in cell.split("/")
        }
        assert cells == {str(sp.action) for spans in sim.spans for sp in spans}, quantum
    assert "\nt 01: 0F1     1F0/1B0\n" in xp.simulate(xp.one_f_one_b(2, 5)).grid(1.5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_grid_quantum_must_be_positive_finite(bad: float) -> None:
    with pytest.raises(ValueError, match=f"quantum must be a finite number > 0, got {bad!r}"):
        xp.simulate(xp.gpipe(2, 1)).grid(bad)


def test_a_step_of_no_time_has_no_bubble_fraction_to_print() -> None:
    """Costs of zero: the idle share is 0/0, and it printed 0.0000."""
    sim = xp.simulate(xp.one_f_one_b(2, 2), {xp.Kind.FORWARD: 0, xp.Kind.BACKWARD: 0})
    assert sim.step_time == 0
    assert "bubble fraction (of total time): undefined (no time)" in sim.summary()
