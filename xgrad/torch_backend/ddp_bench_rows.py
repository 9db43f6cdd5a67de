"""The rows of ``xgrad bench ddp``: one :class:`CaseResult` per model and setting, pooled
from its launches' :class:`CaseSample`, its verdict against the target, and the table the
README shows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from xgrad.bench_stats import (
    interval_label,
    launch_intervals,
    launch_verdict,
    paired_ratios,
    turn_counts,
)
from xgrad.tables import Table, near_limit

__all__ = ["CaseResult", "CaseSample", "pooled", "rows_table", "table"]


@dataclass(frozen=True)
class CaseSample:
    """What one launch measured of one case (rank 0's view; seconds, bytes), unpooled.

    ``*_times`` and ``*_cpu`` hold one entry per turn, in turn order, so that turn ``i``
    of xgrad and of torch pair up.
    """

    model: str
    find_unused: bool
    world: int
    tensors: int
    parameters: int
    xgrad_times: tuple[float, ...]
    torch_times: tuple[float, ...]
    local_times: tuple[float, ...]
    xgrad_cpu: tuple[float, ...]
    torch_cpu: tuple[float, ...]
    xgrad_memory: int
    torch_memory: int
    hook_seconds: float
    #: both sides' steps ran inside their DDP's ``join()``, every rank with even inputs
    join: bool = False

    @property
    def case(self) -> tuple[str, bool, int]:
        return self.model, self.find_unused, self.world


@dataclass
class CaseResult:
    """One row of the table (rank 0's view; times in seconds, memory in bytes)."""

    model: str
    find_unused: bool
    tensors: int
    parameters: int
    xgrad_step: float
    torch_step: float
    xgrad_memory: int
    torch_memory: int
    hook_seconds: float
    world: int = 2
    steps: int = 0
    local_step: float = 0.0
    #: the median of the per-turn ratios xgrad step / PyTorch step, and its 95% interval
    #: (0.0 when not measured: the ratio of the medians stands in).
    paired_ratio: float = 0.0
    ratio_low: float = 0.0
    ratio_high: float = 0.0
    #: median CPU seconds of the whole process (every thread: gloo's, the heartbeat's)
    #: per step of each side: what a faster wall time may cost in CPU.
    xgrad_cpu: float = 0.0
    torch_cpu: float = 0.0
    #: each launch's own ``(low, median, high)`` of the per-turn ratios; the verdict
    #: judges these (empty: the one interval above is the only launch).
    launches: tuple[tuple[float, float, float], ...] = ()
    #: the fewest turns of a launch, and the turns pooled for the interval (0: not known)
    turns: int = 0
    pooled_turns: int = 0
    #: both sides' steps ran inside their DDP's ``join()`` (``--join``), inputs even
    join: bool = False

    @property
    def xgrad_per_grad(self) -> float:
        """What DDP adds to a step, per gradient tensor (hooks, copies, reduction)."""
        return max(self.xgrad_step - self.local_step, 0.0) / self.tensors

    @property
    def torch_per_grad(self) -> float:
        return max(self.torch_step - self.local_step, 0.0) / self.tensors

    @property
    def time_ratio(self) -> float:
        """The median of the paired per-turn ratios (of the medians when not measured)."""
        return self.paired_ratio or self.xgrad_step / self.torch_step

    @property
    def verdict(self) -> str:
        """Against the target (at most 1.00), launch by launch (``launch_verdict``)."""
        if not self.paired_ratio:
            return "met" if self.time_ratio <= 1.0 else "missed"
        launches = self.launches or ((self.ratio_low, self.paired_ratio, self.ratio_high),)
        return launch_verdict(launches, turns=self.turns or None)

    @property
    def cpu_ratio(self) -> float:
        return self.xgrad_cpu / self.torch_cpu if self.torch_cpu > 0 else float("nan")

    @property
    def memory_ratio(self) -> float:
        return self.xgrad_memory / self.torch_memory if self.torch_memory > 0 else float("nan")


def pooled(samples: Sequence[CaseSample]) -> CaseResult:
    """One row from every launch of one case: the turns pooled, each launch kept apart too.

    Step times, CPU and the ratio's median and interval come from all turns together;
    :attr:`CaseResult.launches` keeps each launch's own interval for the verdict. Memory
    is the most any launch measured (what a user may have to hold), the hook time the
    median over launches.
    """
    if not samples:
        raise ValueError("pooled: no launch samples")
    cases = {s.case for s in samples}
    if len(cases) != 1:
        raise ValueError(f"pooled: samples of different cases {sorted(cases)}")
    if len({s.join for s in samples}) != 1:
        raise ValueError(f"pooled: samples of {cases.pop()} with and without join()")
    first = samples[0]
    ratios = [paired_ratios(s.xgrad_times, s.torch_times) for s in samples]
    (low, mid, high), each = launch_intervals(ratios)
    turns, pooled_turns = turn_counts(ratios)

    def every(key: str) -> list[float]:
        return [t for s in samples for t in getattr(s, key)]

    return CaseResult(
        model=first.model,
        find_unused=first.find_unused,
        tensors=first.tensors,
        parameters=first.parameters,
        xgrad_step=statistics.median(every("xgrad_times")),
        torch_step=statistics.median(every("torch_times")),
        xgrad_memory=max(s.xgrad_memory for s in samples),
        torch_memory=max(s.torch_memory for s in samples),
        hook_seconds=statistics.median(s.hook_seconds for s in samples),
        world=first.world,
        steps=len(every("xgrad_times")),
        local_step=statistics.median(every("local_times")),
        paired_ratio=mid,
        ratio_low=low,
        ratio_high=high,
        xgrad_cpu=statistics.median(every("xgrad_cpu")),
        torch_cpu=statistics.median(every("torch_cpu")),
        launches=each,
        turns=turns,
        pooled_turns=pooled_turns,
        join=first.join,
    )


def rows_table(results: list[CaseResult]) -> Table:
    """Every figure of every row, unformatted (times in seconds, memory in bytes); each
    launch's median and interval ends as ``/``-joined text, one entry per launch."""
    extra = (
        "time_ratio",
        "verdict",
        "cpu_ratio",
        "memory_ratio",
        "xgrad_per_grad",
        "torch_per_grad",
    )
    own = tuple(f.name for f in fields(CaseResult) if f.name != "launches")
    per_launch = ("launch_lows", "launch_ratios", "launch_highs")

    def row(r: CaseResult) -> tuple[object, ...]:
        values = asdict(r)
        joined = ("/".join(repr(launch[k]) for launch in r.launches) for k in range(3))
        return (*(values[k] for k in own), *joined, *(getattr(r, k) for k in extra))

    return Table(own + per_launch + extra, tuple(row(r) for r in results), "bench ddp")


def table(results: list[CaseResult]) -> str:
    """The benchmark's table, as the README shows it (Markdown)."""
    pooled = min((r.pooled_turns for r in results if r.pooled_turns), default=0)
    label = interval_label(pooled).replace(" interval", "")
    lines = [
        f"| model | world | find_unused | tensors | xgrad ms | torch ms | time ratio [{label}] "
        "| launches | target | CPU ratio | xgrad MiB | torch MiB | memory ratio | xgrad µs/hook "
        "| xgrad µs/grad | torch µs/grad |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = "-" if r.torch_memory <= 0 else f"{r.memory_ratio:.3f}"
        cpu = "-" if r.torch_cpu <= 0 else f"{r.cpu_ratio:.3f}"
        low, high = near_limit(r.ratio_low), near_limit(r.ratio_high)
        spread = f" [{low}, {high}]" if r.paired_ratio else ""
        launches = "/".join(near_limit(mid) for _, mid, _ in r.launches) or "-"
        lines.append(
            f"| {r.model}{', join' if r.join else ''} | {r.world} | {'yes' if r.find_unused else 'no'} | {r.tensors} "
            f"| {r.xgrad_step * 1e3:.2f} | {r.torch_step * 1e3:.2f} | {near_limit(r.time_ratio)}{spread} "
            f"| {launches} | {r.verdict} | {cpu} "
            f"| {r.xgrad_memory / 2**20:.2f} | {r.torch_memory / 2**20:.2f} "
            f"| {ratio} | {r.hook_seconds * 1e6:.1f} "
            f"| {r.xgrad_per_grad * 1e6:.1f} | {r.torch_per_grad * 1e6:.1f} |"
        )
    return "\n".join(lines)
