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
