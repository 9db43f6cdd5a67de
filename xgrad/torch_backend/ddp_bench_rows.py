"""The rows of ``xgrad bench ddp``: one :class:`CaseResult` per model and setting, its
verdict against the target, and the table the README shows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from xgrad.tables import Table, near_limit

__all__ = ["CaseResult", "rows_table", "table"]


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
        """Against the target (at most 1.00): met, missed, or 1.00 inside the interval."""
        if not self.paired_ratio:
            return "met" if self.time_ratio <= 1.0 else "missed"
        if self.ratio_high <= 1.0:
            return "met"
        return "missed" if self.ratio_low > 1.0 else "noise"

    @property
    def cpu_ratio(self) -> float:
        return self.xgrad_cpu / self.torch_cpu if self.torch_cpu > 0 else float("nan")

    @property
    def memory_ratio(self) -> float:
        return self.xgrad_memory / self.torch_memory if self.torch_memory > 0 else float("nan")


def rows_table(results: list[CaseResult]) -> Table:
    """Every figure of every row, unformatted (times in seconds, memory in bytes)."""
    extra = (
        "time_ratio",
        "verdict",
        "cpu_ratio",
        "memory_ratio",
        "xgrad_per_grad",
        "torch_per_grad",
    )
    rows = [(*asdict(r).values(), *(getattr(r, k) for k in extra)) for r in results]
    columns = tuple(f.name for f in fields(CaseResult)) + extra
    return Table(columns, tuple(rows), "bench ddp")


def table(results: list[CaseResult]) -> str:
    """The benchmark's table, as the README shows it (Markdown)."""
    lines = [
        "| model | world | find_unused | tensors | xgrad ms | torch ms | time ratio [95%] "
        "| target | CPU ratio | xgrad MiB | torch MiB | memory ratio | xgrad µs/hook "
        "| xgrad µs/grad | torch µs/grad |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = "-" if r.torch_memory <= 0 else f"{r.memory_ratio:.3f}"
        cpu = "-" if r.torch_cpu <= 0 else f"{r.cpu_ratio:.3f}"
        low, high = near_limit(r.ratio_low), near_limit(r.ratio_high)
        spread = f" [{low}, {high}]" if r.paired_ratio else ""
        lines.append(
            f"| {r.model} | {r.world} | {'yes' if r.find_unused else 'no'} | {r.tensors} "
            f"| {r.xgrad_step * 1e3:.2f} | {r.torch_step * 1e3:.2f} | {near_limit(r.time_ratio)}{spread} "
            f"| {r.verdict} | {cpu} "
            f"| {r.xgrad_memory / 2**20:.2f} | {r.torch_memory / 2**20:.2f} "
            f"| {ratio} | {r.hook_seconds * 1e6:.1f} "
            f"| {r.xgrad_per_grad * 1e6:.1f} | {r.torch_per_grad * 1e6:.1f} |"
        )
    return "\n".join(lines)
