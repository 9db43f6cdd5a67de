"""Comparing the ranks' parameters: the first mismatch names the rank and the parameter."""

from __future__ import annotations

import torch

from xgrad.torch_backend.sync import describe_params, first_mismatch


def test_first_mismatch_names_rank_and_parameter() -> None:
    p = [torch.zeros(2, 3), torch.zeros(3)]
    same = describe_params(["w", "b"], p)
    assert first_mismatch([same, same]) is None
    other = describe_params(["w", "b"], [torch.zeros(2, 3), torch.zeros(4)])
    assert first_mismatch([same, same, other]) == (
        "parameter 1 differs: rank 2 has 'b' with shape [4] and dtype float32, "
        "rank 0 has 'b' with shape [3] and dtype float32"
    )
    wrong_dtype = describe_params(["w", "b"], [torch.zeros(2, 3, dtype=torch.float64), p[1]])
    assert "dtype float64" in str(first_mismatch([same, wrong_dtype]))
    fewer = describe_params(["w"], p[:1])
    message = first_mismatch([same, fewer])
    assert message is not None
    assert message.startswith("rank 1 has 1 parameters to reduce but rank 0 has 2")
    assert "only rank 0 has is 1" in message


def _state_mismatches(rank: int, world: int) -> dict[str, str]:
    """DDP construction over models whose buffers differ on rank 1 (2 gloo processes)."""
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    out = {}
    for case in ("shape", "extra", "dtype", "frozen", "params", "same"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        if rank == 1 and case == "shape":
            model[1].register_buffer("running_mean", torch.zeros(5))
        if rank == 1 and case == "extra":
            model[0].register_buffer("scale", torch.ones(2))
        if rank == 1 and case == "dtype":
            model[1].running_var = model[1].running_var.double()
        if case == "frozen":
            model.append(nn.Linear(4, 4 if rank == 0 else 2).requires_grad_(False))
        if case == "params":
            model.append(nn.Linear(4, 4 if rank == 0 else 2))
        try:
            DistributedDataParallel(model, timeout=10)
            out[case] = "constructed"
        except RuntimeError as err:  # what code written for PyTorch's DDP catches
            assert isinstance(err, ValueError)  # what xgrad's callers catch
            out[case] = str(err)
    return out


def test_buffers_and_frozen_parameters_that_differ_are_named_on_every_rank() -> None:
    from xgrad.torch_backend.spawn import spawn

    results = spawn(_state_mismatches, 2, timeout=60)
    wanted = {
        # Before: silently broadcast into a buffer of another size (rank 1 keeps junk).
        "shape": "rank 1 has '1.running_mean' with shape [5] and dtype float32, rank 0 has "
        "'1.running_mean' with shape [4]",
        "extra": "rank 1 has '0.scale' with shape [2] and dtype float32, rank 0 has '1.running_mean'",
        # Before: gloo aborted the process (SIGABRT), no Python error.
        "dtype": "rank 1 has '1.running_var' with shape [4] and dtype float64",
        "frozen": "rank 1 has '2.weight' with shape [2, 4]",
        "params": "rank 1 has '2.weight' with shape [2, 4]",
    }
    for rank, result in enumerate(results):
        assert result["same"] == "constructed"
        for case, text in wanted.items():
            assert f"differs across ranks (seen on rank {rank})" in result[case], case
            assert text in result[case], (case, result[case])
