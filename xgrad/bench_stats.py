"""The statistic of xgrad's benches against PyTorch: paired step-time ratios and how sure
their median is (``xgrad bench ddp``, ``xgrad bench pipeline``; no framework needed).

Each timed step of a bench runs xgrad and PyTorch back to back (``xgrad bench ddp`` also
the bare model, turns x-t-l, t-x-l; ``xgrad bench pipeline`` alternates which side goes
first), so the two steps of one turn saw the same load on the machine. The ratio of
those two steps cancels what the turn shared (another process waking up, the allocator
trimming, the clock); the median of the per-turn ratios is what a row reports. The
median of ratios is symmetric: it treats ``xgrad / torch`` and ``torch / xgrad`` alike
(the median of the reciprocals is the reciprocal of the median), so neither side is
favoured by the choice of numerator. Its 95% interval comes from order statistics
(distribution-free: no assumption about how step times spread, no random resampling),
so a reader sees whether 1.00 lies inside the noise of one run.

One run is not enough, though: turns within one launch of processes share what the
launch drew (process placement, allocator layout, ports), and two launches of the same
code have given 1.058 [1.024, 1.084] and 0.994 [0.960, 1.034] (DDP, mlp at world size
4). So the benches run each case in several launches, and the launch, not the turn, is
the unit a verdict counts (:func:`launch_verdict`): with six launches or more, their
medians get a 95% interval of their own, which the verdict judges; with fewer, no such
interval exists, and a verdict is printed only when every launch alone would print it
(:func:`verdict`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "LAUNCHES_FOR_SPREAD",
    "MIN_FOR_INTERVAL",
    "TOO_FEW",
    "interval_label",
    "launch_intervals",
    "launch_verdict",
    "median_interval",
    "paired_ratios",
    "rule",
    "turn_counts",
    "verdict",
]

#: the fewest launches whose medians get a 95% interval of their own (order statistics:
#: the lowest and highest of six cover the median of the launches' distribution with
#: probability 1 - 2 / 2**6 = 96.9%; of five, only 93.8%).
LAUNCHES_FOR_SPREAD = 6
#: the fewest values whose median gets a 95% interval (:func:`median_interval` gives the
#: whole range of fewer, which covers the median only 1 - 2 / 2**n of the time: 50% of 2).
MIN_FOR_INTERVAL = 6
#: the verdict of a row whose launches are too few to judge their medians and each of
#: whose launches has too few turns for an interval of its own.
TOO_FEW = "too-few"


def interval_label(n: int) -> str:
    """What :func:`median_interval` of ``n`` values is: a 95% interval, or a plain range
    (``n`` 0: not counted, as a row made without its turns; named as before the count)."""
    return "95% interval" if n >= MIN_FOR_INTERVAL or n == 0 else f"range of {n}"


def turn_counts(ratios: Sequence[Sequence[float]]) -> tuple[int, int]:
    """Each launch's per-turn ratios in: ``(the fewest turns of a launch, every turn)``,
    what :func:`launch_verdict` and :func:`interval_label` are told."""
    return min(len(r) for r in ratios), sum(len(r) for r in ratios)


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[i] / denominator[i]`` for every turn ``i`` (the lists pair up by turn)."""
    if len(numerator) != len(denominator):
        raise ValueError(
            f"paired_ratios: {len(numerator)} numerator times but {len(denominator)} "
            "denominator times; each turn needs one of each"
        )
    bad = [t for t in denominator if t <= 0]
    if bad:
        raise ValueError(f"paired_ratios: denominator times must be positive, got {bad[0]}")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """``(low, median, high)``: the median and a distribution-free interval around it.

    The interval is ``[x_(k), x_(n+1-k)]`` of the sorted values, with the largest ``k``
    for which it covers the true median with at least ``confidence`` (the number of
    values below the median is Binomial(n, 1/2)). With too few values for that level
    (n < 6 at 95%) it is the whole range.
    """
    if not values:
        raise ValueError("median_interval: values is empty")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"median_interval: confidence must be in (0, 1), got {confidence}")
    ordered = sorted(values)
    n = len(ordered)
    tail = (1.0 - confidence) / 2.0
    # k = how many values each end may drop: P(Binomial(n, 1/2) < k) <= tail.
    k, below = 0, 0.0
    while k < n // 2:
        below_next = below + math.comb(n, k) / 2.0**n
        if below_next > tail:
            break
        below = below_next
        k += 1
    low, high = ordered[max(k - 1, 0)], ordered[n - max(k, 1)]
    return low, statistics.median(ordered), high


def launch_intervals(
    ratios: Sequence[Sequence[float]],
) -> tuple[tuple[float, float, float], tuple[tuple[float, float, float], ...]]:
    """Each launch's per-turn ratios in, two things out: ``(low, median, high)`` of every
    turn pooled (the row's figure) and of each launch alone (what :func:`verdict` judges)."""
    pooled = median_interval([r for launch in ratios for r in launch])
    return pooled, tuple(median_interval(launch) for launch in ratios)


def verdict(intervals: Sequence[tuple[float, float]], limit: float = 1.0) -> str:
    """``met`` / ``missed`` / ``noise``: each launch's ``(low, high)`` interval against ``limit``.

    ``met`` when every launch's interval lies at or below ``limit``, ``missed`` when every
    one lies above it, otherwise ``noise``. Why not the pooled interval: pooling treats
    the turns of all launches as independent, yet the turns of one launch share its
    draw, so the pooled interval narrows with more turns while the drift between
    launches stays; it said "missed" in one launch and "noise" in the next. This rule
    is the pooled verdict's honest form: a reader who reran the bench would have got
    one of these launches, and the verdict printed is one every one of them gives on
    its own (equivalently, the verdict of the union of the launches' intervals). It
    costs sensitivity, not honesty: an interval from fewer turns is wider, so a small
    real gain reads ``noise`` until the launches have turns enough to show it. With one
    launch it is the verdict of that launch's interval.
    """
    if not intervals:
        raise ValueError("verdict: no launch intervals")
    bad = [(low, high) for low, high in intervals if not low <= high]
    if bad:
        raise ValueError(f"verdict: an interval must have low <= high, got {bad[0]}")
    if all(high <= limit for _, high in intervals):
        return "met"
    if all(low > limit for low, _ in intervals):
        return "missed"
    return "noise"


def launch_verdict(
    launches: Sequence[tuple[float, float, float]], limit: float = 1.0, turns: int | None = None
) -> str:
    """``met`` / ``missed`` / ``noise`` from each launch's ``(low, median, high)``, or
    :data:`TOO_FEW` when there are fewer than :data:`LAUNCHES_FOR_SPREAD` launches and
    ``turns`` (the fewest values behind a launch's interval) is under
    :data:`MIN_FOR_INTERVAL`: each launch's "interval" is then its whole range, which
    covers its median less often than 95% (half the time for two turns), and a verdict
    from it would claim more than the run showed.

    With :data:`LAUNCHES_FOR_SPREAD` launches or more, the launches are the sample: the
    verdict judges the 95% interval of their medians (:func:`median_interval`), which
    holds the drift between launches that a pooled interval hides, and which narrows
    only as launches are added, never with more turns in one. With six to eight launches
    that interval runs from the lowest launch median to the highest, so ``met`` means
    that every launch's median is at or below ``limit``. The question it answers is the
    one a user asks, whether a run of the bench typically finds xgrad at or below the
    limit; it no longer asks each launch to show it alone, which the rule for fewer
    launches does (:func:`verdict` of their intervals), since from two to five launch
    medians no 95% interval can be had.
    """
    if not launches:
        raise ValueError("launch_verdict: no launches")
    if len(launches) >= LAUNCHES_FOR_SPREAD:
        low, _, high = median_interval([median for _, median, _ in launches])
        return verdict([(low, high)], limit)
    if turns is not None and turns < MIN_FOR_INTERVAL:
        return TOO_FEW
    return verdict([(low, high) for low, _, high in launches], limit)


def rule(launches: int, limit: float = 1.0, turns: int | None = None) -> str:
    """How :func:`launch_verdict` judges a row of ``launches`` launches (each of at least
    ``turns`` turns, when known), for a bench's header."""
    if launches < LAUNCHES_FOR_SPREAD and turns is not None and turns < MIN_FOR_INTERVAL:
        return (
            f"not judged: {launches} launch(es) of {turns} turn(s) are too few for a 95% "
            f"interval (that needs {LAUNCHES_FOR_SPREAD} launches, or {MIN_FOR_INTERVAL} "
            f"turns a launch), so the verdict is '{TOO_FEW}' and the bracket is the range"
        )
    if launches >= LAUNCHES_FOR_SPREAD:
        return (
            f"judged over the {launches} launches (met: the 95% interval of the launches' "
            f"medians is at most {limit:.2f}"
            + (", i.e. every launch's median is" if launches <= 8 else "")
            + f"; missed: that interval lies above {limit:.2f}; noise: otherwise)"
        )
    return (
        f"judged launch by launch (met: every launch's own 95% interval is at most "
        f"{limit:.2f}; missed: every launch's is above; noise: otherwise, {limit:.2f} inside "
        "one or the launches disagree)"
    )
