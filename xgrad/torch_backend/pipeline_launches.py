"""The launches of ``xgrad bench pipeline``: the speed judged launch by launch, the rest pooled.

The bench splits its timed steps between several launches of fresh processes
(``--launches``), because the steps of one launch share what the launch drew (process
placement, allocator layout, ports): the same code printed 1.012 for 1F1B at p = 4, with
1.00 well inside its quartiles, and 0.985 in the next run. So the speed row's verdict
counts launches (:func:`xgrad.bench_stats.launch_verdict`: from six on, the interval of
their medians; with fewer, met or missed only when every launch alone says so), while the simulator and the memory sections take a
launch as just more steps: :func:`pool` merges the launches' per-rank results into the
results of one launch that ran them all.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xgrad.bench_stats import launch_intervals, launch_verdict, paired_ratios, turn_counts

__all__ = ["Speed", "pool", "speed"]

#: one rank's results of one launch, as the bench's worker returns them.
Result = dict[str, Any]

#: per-step lists a launch's results may carry; pooled by concatenation, in launch order.
_STEP_LISTS = ("torch_steps", "xgrad_steps", "records")
#: each per-step figure's median, recomputed over the pooled steps when every launch has
#: them (else the median of the launches' own medians: results without the steps).
_MEDIANS = {
    "torch": "torch_steps",
    "xgrad": "xgrad_steps",
    "busy": "busy_steps",
    "dispatch": "dispatch_steps",
    "pre": "pre_steps",
    "post": "post_steps",
}


@dataclass(frozen=True)
class Speed:
    """One schedule's speed row: each side's median step (a step's time is its slowest
    rank's), the median of the paired per-step ratios xgrad / torch over every launch with
    its 95% interval, and each launch's own ``(low, median, high)``, which the verdict
    judges."""

    torch_s: float
    xgrad_s: float
    ratio: float
    low: float
    high: float
    launches: tuple[tuple[float, float, float], ...]
    turns: int = 0  # the fewest paired steps of a launch (0: not known)
    pooled: int = 0  # the paired steps behind ``low``..``high`` (0: not known)

    @property
    def verdict(self) -> str:
        """Against the target (at most 1.00), launch by launch (``launch_verdict``)."""
        return launch_verdict(self.launches, turns=self.turns or None)


def _slowest(per_rank: Sequence[Result], name: str, key: str) -> list[float]:
    """Per timed step, the slowest rank's time (the step is done when every rank is)."""
    return [max(ts) for ts in zip(*(r[name][key] for r in per_rank), strict=True)]


def speed(launches: Sequence[Sequence[Result]], name: str) -> Speed:
    """The speed row of ``name`` from every launch's per-rank results.

    Pairing step by step cancels the machine's slow drift (both sides of a pair ran back
    to back). Results without per-step times give each launch the ratio of its medians,
    as a point.
    """
    if not launches:
        raise ValueError(f"speed: no launches of {name!r}")
    if all("torch_steps" in r[name] for per_rank in launches for r in per_rank):
        theirs = [_slowest(per_rank, name, "torch_steps") for per_rank in launches]
        ours = [_slowest(per_rank, name, "xgrad_steps") for per_rank in launches]
        ratios = [paired_ratios(o, t) for o, t in zip(ours, theirs, strict=True)]
        (low, mid, high), each = launch_intervals(ratios)
        turns, pooled = turn_counts(ratios)
        return Speed(
            statistics.median(t for launch in theirs for t in launch),
            statistics.median(t for launch in ours for t in launch),
            mid,
            low,
            high,
            each,
            turns=turns,
            pooled=pooled,
        )
    torch_s = [max(r[name]["torch"] for r in per_rank) for per_rank in launches]
    xgrad_s = [max(r[name]["xgrad"] for r in per_rank) for per_rank in launches]
    points = [o / t for o, t in zip(xgrad_s, torch_s, strict=True)]
    return Speed(
        statistics.median(torch_s),
        statistics.median(xgrad_s),
        statistics.median(points),
        min(points),
        max(points),
        tuple((p, p, p) for p in points),
    )


def pool(launches: Sequence[Sequence[Result]], names: Sequence[str]) -> list[Result]:
    """Per rank, the results of one launch that ran every launch's steps.

    Per-step lists (times, action records, cost samples) are joined and every median
    recomputed from them; the ping-pong message cost is the launches' median; memory
    peaks are the most any launch measured (what a user may have to hold).
    """
    if not launches:
        raise ValueError("pool: no launches")
    sizes = sorted({len(per_rank) for per_rank in launches})
    if len(sizes) != 1:
        raise ValueError(f"pool: launches of different numbers of ranks {sizes}")
    pooled = []
    for rank in range(sizes[0]):
        mine = [per_rank[rank] for per_rank in launches]
        res: Result = {"message": statistics.median(m["message"] for m in mine)}
        for name in names:
            res[name] = _pool_schedule([m[name] for m in mine])
        pooled.append(res)
    return pooled


def _pool_schedule(parts: Sequence[Result]) -> Result:
    """One rank's results of one schedule, from each launch's."""
    out: Result = {}
    for key in (*_STEP_LISTS, *_MEDIANS.values()):
        if all(key in part for part in parts):
            out[key] = [x for part in parts for x in part[key]]
    for key, steps in _MEDIANS.items():
        out[key] = statistics.median(out[steps] if steps in out else (p[key] for p in parts))
    samples: dict[tuple[int, str], list[float]] = {}
    for part in parts:
        for key, values in part.get("samples", {}).items():
            samples.setdefault(key, []).extend(values)
    if samples:
        out["samples"] = samples
        out["costs"] = {key: statistics.mean(values) for key, values in samples.items()}
    else:  # results without samples: each launch's mean, weighted alike
        keys = dict.fromkeys(key for part in parts for key in part["costs"])
        out["costs"] = {
            key: statistics.mean(p["costs"][key] for p in parts if key in p["costs"])
            for key in keys
        }
    out["peaks"] = {key: max(p["peaks"][key] for p in parts) for key in parts[0]["peaks"]}
    return out
