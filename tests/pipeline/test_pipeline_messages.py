"""The runtime-shaped simulation: sends, receives, dispatch and latency on the clock."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Kind


def _unit(a: Action) -> float:
    return xp.DEFAULT_COSTS[a.kind] if a.kind.is_compute else 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"])
def test_free_messages_give_the_compute_only_simulation(name: str) -> None:
    schedule = xp.make(name, 2, 4)
    plain = xp.simulate(schedule)
    sim = xp.simulate_messages(schedule, _unit)
    assert sim.busy == pytest.approx(plain.busy)
    # An overlapped F/B pair sends both results after the pair, as the runtime does, in
    # both simulators (simulate() let the forward's output leave as the forward ended, so
    # DualPipeV's consumers started early: 25 against 26 here, 51 against 54 at p = 4).
    assert sim.makespan == pytest.approx(plain.makespan)
    assert sim.spans == plain.spans


@pytest.mark.parametrize(("p", "m", "makespan"), [(4, 8, 54.0), (5, 10, 97.0)])
def test_dualpipev_pairs_send_at_their_end_in_both_simulators(
    p: int, m: int, makespan: float
) -> None:
    schedule = xp.make("dualpipev", p, m)
    latency = 1.0 if p == 5 else 0.0
    plain = xp.simulate(schedule, comm_cost=latency)
    sim = xp.simulate_messages(schedule, _unit, latency=latency)
    assert plain.makespan == sim.makespan == makespan


def test_send_cost_latency_and_dispatch_land_where_the_runtime_spends_them() -> None:
    # gpipe, 2 ranks, 1 microbatch: 0F0 0SEND_F0 | 1RECV_F0 1F0 1B0 1SEND_B0 | 0RECV_B0 0B0
    costs = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.SEND_F: 0.5, Kind.SEND_B: 0.25}
    costs[Kind.RECV_F] = costs[Kind.RECV_B] = 0.125

    def cost(a: Action) -> float:
        return costs[a.kind]

    sim = xp.simulate_messages(xp.gpipe(2, 1), cost, latency=0.5, dispatch=0.0625)
    (f0,), (f1, b1), (b0,) = (
        [s for s in sim.spans[0] if s.action.kind is Kind.FORWARD],
        sim.spans[1],
        [s for s in sim.spans[0] if s.action.kind is Kind.BACKWARD],
    )
    assert f0.start == pytest.approx(0.0625)  # one dispatch
    # 0F0 ends at 1.0625; its send (after a dispatch) ends at 1.625; +0.5 latency.
    assert f1.start == pytest.approx(2.125)
    assert b1.start == pytest.approx(f1.end + 0.0625)
    # 1SEND_B0 ends at b1.end + 0.0625 + 0.25, then the latency.
    assert b0.start == pytest.approx(b1.end + 0.0625 + 0.25 + 0.5)
    assert sim.busy == pytest.approx((3.0, 3.0))
    assert sim.makespan == pytest.approx(b0.end)


def test_a_negative_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        xp.simulate_messages(xp.gpipe(2, 2), lambda a: -1.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_impossible_costs_latencies_and_dispatches_are_named(bad: float) -> None:
    s, one = xp.gpipe(2, 2), lambda a: 1.0
    got = f"must be >= 0 and finite, got {bad!r}"
    with pytest.raises(ValueError, match=rf"cost\(0F1\) {got}"):
        xp.simulate_messages(s, lambda a: bad if str(a) == "0F1" else 1.0)
    with pytest.raises(ValueError, match=f"latency {got}"):
        xp.simulate_messages(s, one, latency=bad)
    with pytest.raises(ValueError, match=rf"latency\(0SEND_F0\) {got}"):
        xp.simulate_messages(s, one, latency=lambda a: bad)
    with pytest.raises(ValueError, match=f"dispatch {got}"):
        xp.simulate_messages(s, one, dispatch=bad, cores=1)
    with pytest.raises(ValueError, match=rf"dispatch\(1\) \(rank 1\) {got}"):
        xp.simulate_messages(s, one, dispatch=lambda r: bad if r else 0.0)


def test_zero_costs_are_a_zero_step() -> None:
    for cores in (None, 1):
        sim = xp.simulate_messages(xp.gpipe(2, 2), lambda a: 0.0, cores=cores)
        assert (sim.step_time, sim.makespan, sim.bubble_fraction) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_zb", "dualpipev"])
def test_as_many_shared_cores_as_ranks_is_a_core_each(name: str) -> None:
    schedule = xp.make(name, 2, 4)

    def cost(a: Action) -> float:  # uneven, so that an ordering mistake would show
        return (1.0 + 0.1 * a.stage + 0.01 * a.microbatch) * (2 if a.kind.is_compute else 0.1)

    own = xp.simulate_messages(schedule, cost, latency=0.3, dispatch=0.05)
    shared = xp.simulate_messages(schedule, cost, latency=0.3, dispatch=0.05, cores=2)
    assert shared.makespan == pytest.approx(own.makespan)
    assert shared.busy == pytest.approx(own.busy)


def test_one_core_runs_the_ranks_one_at_a_time() -> None:
    # 1F1B on 2 ranks, no latency: some rank always has work, so one core is never idle and
    # the step is all the work; each pass is stretched while both ranks have work.
    sim = xp.simulate_messages(xp.one_f_one_b(2, 4), _unit, cores=1)
    assert sim.makespan == pytest.approx(2 * 4 * 3.0)
    assert sum(sim.busy) > 2 * 4 * 3.0  # wall time of passes, slowed by the sharing
    with pytest.raises(ValueError, match="cores must be >= 1"):
        xp.simulate_messages(xp.gpipe(2, 2), _unit, cores=0)


def test_a_latency_per_message_delays_only_its_own_receiver() -> None:
    # gpipe, 2 ranks, 2 microbatches, unit costs: only 0SEND_F1 is late, by 3.
    late = Action(0, Kind.SEND_F, 1)
    base = xp.simulate_messages(xp.gpipe(2, 2), _unit)
    sim = xp.simulate_messages(xp.gpipe(2, 2), _unit, latency=lambda s: 3.0 * (s == late))
    start = {s.action: s.start for spans in sim.spans for s in spans}
    before = {s.action: s.start for spans in base.spans for s in spans}
    assert start[Action(1, Kind.FORWARD, 0)] == before[Action(1, Kind.FORWARD, 0)]
    assert start[Action(1, Kind.FORWARD, 1)] == pytest.approx(
        before[Action(1, Kind.FORWARD, 1)] + 3.0
    )
