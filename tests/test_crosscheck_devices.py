"""The CUDA-against-CPU comparison of the crosscheck, exercised with CPU runs on both sides."""

from __future__ import annotations

import dataclasses

import numpy as np

from xgrad.backend import runner_entries
from xgrad.crosscheck import Case, make_inputs
from xgrad.crosscheck.devices import cuda_vs_cpu
from xgrad.crosscheck.run import BackendReport
from xgrad.crosscheck.runners import step_of


def test_lines_say_identical_or_how_far() -> None:
    """The reference runner's own CPU gradients as the 'CUDA' side: identical; perturbed:
    how far and which parameter (the comparison itself does not need a GPU)."""
    inputs = make_inputs(Case(steps=1))
    entry = next(e for e in runner_entries(["reference"]))
    step = dataclasses.replace(step_of(inputs), device="cuda")
    grads = entry.runner.run(dataclasses.replace(step, device="cpu")).grads
    same = BackendReport("reference", "", "ok", grads=dict(grads))
    assert cuda_vs_cpu([entry], [same], step) == ["reference cuda vs cpu: bit-identical"]
    off = dict(grads)
    off["layers.0.weight"] = grads["layers.0.weight"] * np.float32(1.001)
    [line] = cuda_vs_cpu([entry], [BackendReport("reference", "", "ok", grads=off)], step)
    assert line.startswith("reference cuda vs cpu: 1/6 parameters differ, max rel 0.001")
    assert "layers.0.weight" in line and "TF32-sized" in line
