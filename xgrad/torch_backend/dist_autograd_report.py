"""What ``xgrad bench dist-autograd`` prints: its launches' passes pooled and judged.

Kept apart from the bench's passes and processes (:mod:`.dist_autograd_bench`): this part
is plain arithmetic on the times each launch returns, testable without a process group.

The two implementations run in alternating blocks of passes (PyTorch's RPC agent is
started for each of its blocks and shut down after, see the bench), so a block of xgrad
and the PyTorch block right after it saw the same machine: the ratio of their medians
cancels what the pair shared, as a turn's does in the other benches. Those block ratios
are judged as theirs are (:mod:`xgrad.bench_stats`): the median of every launch's block
ratios with its 95% interval, each launch's own median, and a verdict that counts
launches, since a launch's blocks share what its processes drew.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xgrad.bench_stats import interval_label, launch_intervals, launch_verdict, rule, turn_counts
from xgrad.tables import Table

__all__ = ["Summary", "render", "summarize"]

#: one launch's results from rank 0 (see the bench's ``_worker``).
Launch = dict[str, Any]


def _block_ratios(launch: Launch) -> list[float]:
    """Per block, the median of xgrad's backward passes over the median of PyTorch's."""
    ours, theirs, start = launch["xgrad_times"], launch["torch_times"], 0
    ratios = []
    for n in launch["blocks"]:
        block = slice(start, start + n)
        ratios.append(statistics.median(ours[block]) / statistics.median(theirs[block]))
        start += n
    return ratios


@dataclass(frozen=True)
class Summary:
    """Every launch pooled: each side's median (seconds) of the backward, of the whole
    pass and of the CPU per pass (every rank), the backward's block ratio with its
    interval and each launch's, and the largest gradient difference of any launch."""

    backward: tuple[float, float]  # (torch, xgrad)
    whole: tuple[float, float]
    cpu: tuple[float, float]
    ratio: tuple[float, float, float]  # (low, median, high)
    launches: tuple[tuple[float, float, float], ...]
    diff: float
    other: tuple[float, float] | None  # (seconds, gradient difference) of --ab's execution
    turns: int = 0  # the fewest blocks of a launch (0: not known)
    pooled: int = 0  # the block ratios behind ``ratio`` (0: not known)

    @property
    def verdict(self) -> str:
        """Against the target, xgrad faster (at most 1.00), counting launches."""
        return launch_verdict(self.launches, turns=self.turns or None)


def summarize(launches: Sequence[Launch]) -> Summary:
    """Pool the launches: passes by concatenation, block ratios per launch."""
    if not launches:
        raise ValueError("summarize: no launches")

    def pooled(key: str) -> float:  # every launch's passes together
        return statistics.median(t for launch in launches for t in launch[key])

    def across(key: str) -> float:  # one figure per launch
        return statistics.median(launch[key] for launch in launches)

    ratios = [_block_ratios(launch) for launch in launches]
    pooled_ratio, each = launch_intervals(ratios)
    turns, counted = turn_counts(ratios)
    other = None
    if all("other_times" in launch for launch in launches):
        other = (pooled("other_times"), max(launch["other_diff"] for launch in launches))
    return Summary(
        backward=(pooled("torch_times"), pooled("xgrad_times")),
        whole=(pooled("torch_pass_times"), pooled("xgrad_pass_times")),
        cpu=(across("torch_cpu"), across("xgrad_cpu")),
        ratio=pooled_ratio,
        launches=each,
        diff=max(launch["diff"] for launch in launches),
        other=other,
        turns=turns,
        pooled=counted,
    )


def render(
    args: argparse.Namespace, s: Summary, execute: str, ab: str | None, blocks: int
) -> tuple[str, list[Table]]:
    """The text and the tables (``--json``/``--csv``) of a summary."""
    (t_back, x_back), (t_pass, x_pass), (t_cpu, x_cpu) = s.backward, s.whole, s.cpu
    low, mid, high = s.ratio
    pass_ratio, cpu_ratio = x_pass / t_pass, (x_cpu / t_cpu if t_cpu > 0 else float("nan"))
    n = len(s.launches)
    label = interval_label(s.pooled)
    each = "/".join(f"{m:.3f}" for _, m, _ in s.launches)
    text = (
        f"dist-autograd: {args.world} ranks, {args.size}x{args.size} {args.dtype} weights, "
        f"batch {args.batch}, {args.iters} backward passes each in each of {n} launch(es) of "
        f"fresh processes ({blocks} alternating blocks per launch); the ms columns are "
        f"medians over every launch; ratio: the median over every block of xgrad's median "
        f"over PyTorch's in the block right after [{label}]; target <= 1.00 (xgrad "
        f"faster), {rule(n, turns=s.turns or None)}; launches: each launch's median block "
        f"ratio\n"
        f"{'':8} {'torch_rpc_ms':>12} {'xgrad_ms':>10} {'ratio':>7}  {label:<16} "
        f"target  launches\n"
        f"{'backward':8} {t_back * 1e3:12.3f} {x_back * 1e3:10.3f} {mid:7.3f}  "
        f"[{low:.3f}, {high:.3f}]  {s.verdict:<7} {each}\n"
        f"{'pass':8} {t_pass * 1e3:12.3f} {x_pass * 1e3:10.3f} {pass_ratio:7.3f}\n"
        f"{'cpu':8} {t_cpu * 1e3:12.3f} {x_cpu * 1e3:10.3f} {cpu_ratio:7.3f}\n"
        f"  (pass: rank 0's whole pass, from entering the context to leaving it: forward,\n"
        f"  backward and the context's end; ratio of the medians, not judged)\n"
        f"  (cpu: CPU time of every thread of every rank per timed pass, forward and backward;\n"
        f"  PyTorch's RPC agent polls its transport on a thread of each process meanwhile)\n"
        f"largest gradient difference (xgrad vs torch rpc): {s.diff:.3e}"
    )
    setup = (args.world, args.size, args.batch, args.dtype, args.iters, n)
    columns = ("world", "size", "batch", "dtype", "iters", "launches")
    row = (
        *setup, t_back * 1e3, x_back * 1e3, mid, low, high, s.verdict, each, s.diff,
        t_cpu * 1e3, x_cpu * 1e3, cpu_ratio, t_pass * 1e3, x_pass * 1e3, pass_ratio,
    )  # fmt: skip
    names = (
        *columns, "torch_rpc_ms", "xgrad_ms", "ratio", "ratio_low", "ratio_high", "verdict",
        "launch_ratios", "max_grad_diff", "torch_rpc_cpu_ms", "xgrad_cpu_ms", "cpu_ratio",
        "torch_rpc_pass_ms", "xgrad_pass_ms", "pass_ratio",
    )  # fmt: skip
    tables = [Table(names, (row,), "bench dist-autograd")]
    if s.other is not None and ab is not None:
        other, other_diff = s.other
        ms = {execute: x_back, ab: other}
        text += (
            f"\nA/B, same blocks: xgrad {execute} (default) {x_back * 1e3:.3f} ms, "
            f"{ab} {other * 1e3:.3f} ms (ratio to torch rpc {other / t_back:.3f}, gradient "
            f"difference {other_diff:.3e}); waves/nodes {ms['waves'] / ms['nodes']:.3f}"
        )
        ab_row = (*setup[:5], ms["nodes"] * 1e3, ms["waves"] * 1e3, ms["waves"] / ms["nodes"])
        ab_columns = ("world", "size", "batch", "dtype", "iters", "nodes_ms", "waves_ms", "ratio")
        tables.append(Table(ab_columns, (ab_row,), "bench dist-autograd waves vs nodes"))
    return text, tables
