"""Where CUDA changes the numbers: each runner's CUDA gradients against its own CPU run.

On a GPU the same plan and data can give other bits than on the CPU: TF32 matrix products
(JAX's default float32 precision on recent GPUs; PyTorch's convolutions), other reduction
orders inside kernels and in NCCL's allreduce. Re-running each runner on the CPU with the
very same step and comparing parameter by parameter says which, and by how much.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from xgrad.backend import Entry, Step
from xgrad.crosscheck.metrics import bit_identical, compare


def cuda_vs_cpu(entries: Sequence[Entry], reports: Sequence[Any], step: Step) -> list[str]:
    """One line per runner that ran on CUDA: bit-identical to its CPU run, or how far off.

    Args:
        entries: the runners, in the order of ``reports``.
        reports: their CUDA outcomes (``grads`` filled for those that ran).
        step: the CUDA step; its CPU twin is the same step with ``device="cpu"``.
    """
    cpu_step = dataclasses.replace(step, device="cpu")
    names = list(step.weights)
    lines = []
    for entry, report in zip(entries, reports, strict=True):
        runner = entry.runner
        if runner is None or not report.grads:
            continue
        reason = runner.unsupported(cpu_step)
        if reason:
            lines.append(f"{report.name} cuda vs cpu: no CPU run ({reason})")
            continue
        try:
            cpu = runner.run(cpu_step).grads
        except Exception as err:  # reported, like any backend's failure
            lines.append(
                f"{report.name} cuda vs cpu: the CPU run failed ({type(err).__name__}: {err})"
            )
            continue
        if all(bit_identical(report.grads[n], cpu[n]) for n in names):
            lines.append(f"{report.name} cuda vs cpu: bit-identical")
            continue
        metrics = [compare(n, report.grads[n], cpu[n], math.inf) for n in names]
        worst = max(metrics, key=lambda m: m.rel)
        differing = sum(not bit_identical(report.grads[n], cpu[n]) for n in names)
        lines.append(
            f"{report.name} cuda vs cpu: {differing}/{len(names)} parameters differ, max rel "
            f"{worst.rel:.3g} ({worst.name}, {worst.ulp_at_max:.3g} ULPs at its scale)"
            + (" — TF32-sized (~1e-3)" if worst.rel > 1e-4 else " — reduction-order-sized")
        )
    return lines
