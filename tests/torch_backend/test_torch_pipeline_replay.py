"""A measured step replayed in the simulator from its own costs and message latencies."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.pipeline_replay import (
    action_span,
    message_latencies,
    replay_step,
    replay_steps,
    step_costs,
)


def _gpipe_step(wake: float = 1.5) -> list[list[tuple[str, float, float, float]]]:
    """Records of one gpipe(2, 1) step as the runtime writes them (action, start, end,
    seconds blocked). Rank 0: F0 takes 1.0, its send 0.2; B0 starts at 1.2, is blocked
    until 3.7 (the gradient's send ended at 3.5), then computes 2.0. Rank 1: F0 starts at
    0, blocked until ``wake`` (the activation's send ended at 1.2), computes 1.0; B0 0.8;
    its send 0.2."""
    f1_end = wake + 1.0
    b1_end = f1_end + 0.8
    send_b_end = b1_end + 0.2
    b0_wake = send_b_end + 0.2
    return [
        [
            ("0F0", 0.0, 1.0, 0.0),
            ("0SEND_F0", 1.0, 1.2, 0.0),
            ("0RECV_B0", 1.2, 1.2, 0.0),
            ("0B0", 1.2, b0_wake + 2.0, b0_wake - 1.2),
        ],
        [
            ("1RECV_F0", 0.0, 0.0, 0.0),
            ("1F0", 0.0, f1_end, wake),
            ("1B0", f1_end, b1_end, 0.0),
            ("1SEND_B0", b1_end, send_b_end, 0.0),
        ],
    ]


def test_each_message_gets_the_latency_its_blocked_receiver_saw() -> None:
    schedule = xp.insert_comms(xp.gpipe(2, 1))
    lags = message_latencies(schedule, _gpipe_step())
    assert lags == pytest.approx({Action(0, Kind.SEND_F, 0): 0.3, Action(1, Kind.SEND_B, 0): 0.2})
    costs = step_costs(_gpipe_step())
    assert costs[Action(0, Kind.BACKWARD, 0)] == pytest.approx(2.0)  # blocked time left out
    assert costs[Action(1, Kind.FORWARD, 0)] == pytest.approx(1.0)


def test_a_step_replayed_from_its_own_costs_takes_what_it_took() -> None:
    schedule = xp.gpipe(2, 1)
    seconds, busy = replay_step(schedule, _gpipe_step())
    assert seconds == pytest.approx(5.7)  # rank 0's B0 ends at 3.7 + 2.0
    assert busy == pytest.approx(1.0 + 2.0 + 1.0 + 0.8)
    # A receiver that woke before its send ended (it preempted the sender): no negative
    # latency, the data is there when the send ends (1.2), and everything after is later.
    early, _ = replay_step(schedule, _gpipe_step(wake=1.1))
    assert message_latencies(xp.insert_comms(schedule), _gpipe_step(wake=1.1))[
        Action(0, Kind.SEND_F, 0)
    ] == pytest.approx(-0.1)
    # Rank 1: F0 1.2-2.2, B0 -3.0, its send -3.2, +0.2 latency; rank 0's B0 3.4-5.4.
    assert early == pytest.approx(5.4)


def test_replayed_steps_give_medians_and_bubbles_from_the_same_compute() -> None:
    schedule = xp.gpipe(2, 1)
    steps = [_gpipe_step(1.5), _gpipe_step(1.5), _gpipe_step(2.5)]
    fixed = 0.5
    out = replay_steps(schedule, steps, [6.0, 6.4, 7.0], fixed)
    assert out.measured == pytest.approx(6.4)
    assert out.simulated == pytest.approx(5.7 + fixed)
    busy = 4.8
    assert out.bubble_measured == pytest.approx(1 - busy / (2 * 6.4))
    assert out.bubble_simulated == pytest.approx(1 - busy / (2 * (5.7 + fixed)))
    with pytest.raises(ValueError, match=r"steps \(3\) and times \(2\) must match"):
        replay_steps(schedule, steps, [6.0, 6.4], fixed)


def test_each_step_keeps_its_own_time_outside_the_actions() -> None:
    # Without a fixed part given, each step's is its measured time less its actions'
    # span (0 to 5.7 here): what the simulator does not model, taken as measured.
    schedule = xp.gpipe(2, 1)
    steps = [_gpipe_step(1.5), _gpipe_step(1.5), _gpipe_step(1.5)]
    assert action_span(steps[0]) == pytest.approx(5.7)
    out = replay_steps(schedule, steps, [6.0, 6.4, 7.0])
    assert out.fixed == pytest.approx(0.7)
    # Each step's own costs and own fixed part give back each step's time.
    assert out.simulated == pytest.approx(out.measured) == pytest.approx(6.4)
    assert out.bubble_simulated == pytest.approx(out.bubble_measured)
