"""The benches' statistic: paired ratios, and a distribution-free interval for their median."""

from __future__ import annotations

import math
import random

import pytest

from xgrad.bench_stats import (
    LAUNCHES_FOR_SPREAD,
    TOO_FEW,
    interval_label,
    launch_intervals,
    launch_verdict,
    median_interval,
    paired_ratios,
    rule,
    turn_counts,
    verdict,
)


def test_paired_ratios_pair_by_turn() -> None:
    assert paired_ratios([2.0, 3.0, 1.0], [1.0, 6.0, 1.0]) == [2.0, 0.5, 1.0]


def test_paired_ratios_refuse_unpaired_or_non_positive_times() -> None:
    with pytest.raises(ValueError, match="3 numerator times but 2 denominator"):
        paired_ratios([1.0, 1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"must be positive, got 0\.0"):
        paired_ratios([1.0], [0.0])


def test_interval_is_the_order_statistics_of_the_binomial() -> None:
    # n = 120: the 95% interval of the median is [x_49, x_72] (1-based).
    low, mid, high = median_interval([float(i) for i in range(1, 121)])
    assert (low, mid, high) == (49.0, 60.5, 72.0)
    # Too few values for 95%: the whole range.
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)


def test_interval_covers_the_true_median_about_95_percent_of_the_time() -> None:
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        low, _, high = median_interval([rng.lognormvariate(0.0, 0.3) for _ in range(60)])
        covered += low <= 1.0 <= high  # the lognormal's median is exp(0) = 1
    assert 0.93 <= covered / trials <= 0.99


def test_median_of_ratios_is_symmetric_in_the_two_sides() -> None:
    rng = random.Random(1)
    a = [rng.uniform(0.9, 1.2) for _ in range(41)]
    b = [rng.uniform(0.9, 1.2) for _ in range(41)]
    _, forward, _ = median_interval(paired_ratios(a, b))
    _, backward, _ = median_interval(paired_ratios(b, a))
    assert math.isclose(forward * backward, 1.0)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="values is empty"):
        median_interval([])
    with pytest.raises(ValueError, match="confidence must be in"):
        median_interval([1.0], confidence=1.5)


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([(0.95, 0.99)], "met"),
        ([(0.95, 1.0)], "met"),  # at most 1.00 is the target
        ([(0.98, 1.02)], "noise"),
        ([(1.0, 1.05)], "noise"),
        ([(1.001, 1.05)], "missed"),
        ([(0.95, 0.99), (0.96, 0.999)], "met"),
        ([(1.02, 1.08), (1.01, 1.04)], "missed"),
        # One launch meets and the other misses: which launch the reader got decides.
        ([(0.96, 0.99), (1.02, 1.08)], "noise"),
        # The two launches of one measured case: 1.058 [1.024, 1.084], 0.994 [0.960, 1.034].
        ([(1.024, 1.084), (0.960, 1.034)], "noise"),
        ([(0.95, 0.99), (0.97, 1.01)], "noise"),
        ([(1.02, 1.08), (0.99, 1.03)], "noise"),
        ([(0.95, 0.99), (0.96, 0.98), (0.97, 1.001)], "noise"),
    ],
)
def test_a_verdict_is_one_every_launch_gives(
    intervals: list[tuple[float, float]], expected: str
) -> None:
    assert verdict(intervals) == expected
    # Launch order does not matter.
    assert verdict(intervals[::-1]) == expected


def test_the_verdict_judges_against_the_limit_given() -> None:
    assert verdict([(1.05, 1.08), (1.06, 1.09)], limit=1.1) == "met"
    assert verdict([(0.90, 0.95)], limit=0.8) == "missed"


def test_verdict_refuses_no_launch_or_an_inverted_interval() -> None:
    with pytest.raises(ValueError, match="no launch intervals"):
        verdict([])
    with pytest.raises(ValueError, match=r"low <= high, got \(1\.1, 0\.9\)"):
        verdict([(0.9, 1.0), (1.1, 0.9)])


def test_launch_intervals_pool_every_turn_and_keep_each_launch_apart() -> None:
    first, second = [0.9, 1.0, 1.1], [1.2, 1.3, 1.4, 1.5]
    pooled, each = launch_intervals([first, second])
    assert pooled == median_interval(first + second)
    assert each == (median_interval(first), median_interval(second))


def _launches(medians: list[float], half_width: float = 0.05) -> list[tuple[float, float, float]]:
    return [(m - half_width, m, m + half_width) for m in medians]


def test_six_launches_are_judged_by_the_interval_of_their_medians() -> None:
    assert LAUNCHES_FOR_SPREAD == 6
    # Every launch's median below 1.00, though 1.00 lies inside each launch's own interval:
    # the typical launch is below the target (per-launch rule: noise).
    below = _launches([0.95, 0.97, 0.96, 0.98, 0.94, 0.99])
    assert launch_verdict(below) == "met"
    assert verdict([(low, high) for low, _, high in below]) == "noise"
    assert launch_verdict(_launches([1.02, 1.05, 1.01, 1.03, 1.04, 1.06])) == "missed"
    # One launch across the limit: with six, the interval is the whole range of medians.
    assert launch_verdict(_launches([0.95, 0.97, 0.96, 0.98, 0.94, 1.01])) == "noise"
    # With nine, the interval drops the lowest and highest median: one launch above the
    # limit no longer decides, two do.
    nine = [0.95, 0.97, 0.96, 0.98, 0.94, 0.99, 0.93, 0.96]
    assert launch_verdict(_launches([*nine, 1.08])) == "met"
    assert launch_verdict(_launches([*nine[:-1], 1.02, 1.08])) == "noise"
    assert launch_verdict(_launches([1.05] * 6), limit=1.1) == "met"


def test_fewer_launches_keep_the_rule_of_each_launch_alone() -> None:
    five = _launches([0.95, 0.97, 0.96, 0.98, 0.94])
    assert launch_verdict(five) == verdict([(low, high) for low, _, high in five]) == "noise"
    assert launch_verdict(_launches([0.90, 0.92], half_width=0.03)) == "met"
    assert launch_verdict([(0.97, 0.98, 1.01)]) == "noise"
    with pytest.raises(ValueError, match="no launches"):
        launch_verdict([])


def test_too_few_turns_for_an_interval_give_no_verdict_and_say_range() -> None:
    """Under six values :func:`median_interval` gives the whole range, which covers the
    median only 1 - 2 / 2**n of the time: a launch of two turns was judged ``met`` or
    ``missed`` from it, under a header that said "95% interval"."""
    two = [(0.90, 0.95, 0.99)]
    assert launch_verdict(two) == "met"  # turns not known: as before
    assert launch_verdict(two, turns=2) == TOO_FEW
    assert launch_verdict(two, turns=6) == "met"
    assert launch_verdict(_launches([0.95] * 6), turns=2) == "met"  # six launches' medians
    assert interval_label(2) == "range of 2" and interval_label(6) == "95% interval"
    assert interval_label(0) == "95% interval"  # not counted: as printed before the count
    assert turn_counts([[1.0, 0.9], [1.1, 1.0, 0.95]]) == (2, 5)
    assert "not judged" in rule(1, turns=2) and "not judged" not in rule(6, turns=2)
    assert "not judged" not in rule(1, turns=6)
