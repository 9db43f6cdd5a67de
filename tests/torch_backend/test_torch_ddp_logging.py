"""``_get_ddp_logging_data()`` keys, values and sampling as PyTorch's logger's, side by side.

PyTorch's own test of it (``test_ddp_logging_data_cpu``) checks the environment keys, the
iteration of the last sampled step (sample rate 2: every step up to 10, then the even
ones), the rebuilt buckets, the ready order and the ordering of the host-side times.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from xgrad.torch_backend.spawn import spawn  # noqa: E402

STEPS = 20


def _logged(rank: int, world: int) -> dict[str, Any]:
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    out: dict[str, Any] = {}
    for name, wrap in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        ddp = wrap(copy.deepcopy(model))
        ddp._set_ddp_runtime_logging_sample_rate(2)
        seen = [dict(ddp._get_ddp_logging_data())]
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(STEPS):
            optimizer.zero_grad()
            ddp(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            seen.append(dict(ddp._get_ddp_logging_data()))
        out[name] = seen
    return out


@pytest.fixture(scope="module")
def logged() -> list[dict[str, Any]]:
    return spawn(_logged, 2, timeout=120)


def test_the_same_keys_as_pytorch_before_and_after_steps(logged: list[dict[str, Any]]) -> None:
    for rank_result in logged:
        ours, theirs = rank_result["xgrad"], rank_result["torch"]
        for idx in (0, 1, 2, STEPS):
            assert sorted(ours[idx]) == sorted(theirs[idx]), idx


def test_values_pytorch_sets_alike(logged: list[dict[str, Any]]) -> None:
    fixed = (
        "master_port",
        "master_addr",
        "torch_distributed_debug",
        "cuda_visible_devices",
        "gloo_socket_ifname",
        "gloo_device_transport",
        "gloo_num_threads",
        "iteration",
        "has_rebuilt_buckets",
        "num_buckets_reduced",
        "bucket_sizes",
        "rebuilt_bucket_sizes",
        "rebuilt_per_bucket_param_indices",
        "prev_iteration_grad_ready_order_indices",
        "unused_parameter_size",
    )
    for rank_result in logged:
        for ours, theirs in zip(rank_result["xgrad"], rank_result["torch"], strict=True):
            assert {k: ours.get(k) for k in fixed} == {k: theirs.get(k) for k in fixed}


def test_sampled_steps_and_their_times_as_pytorchs_test_checks(
    logged: list[dict[str, Any]],
) -> None:
    for rank_result in logged:
        for idx, data in enumerate(rank_result["xgrad"][1:]):
            if idx > 0 and (idx < 10 or idx % 2 == 0):
                assert data["iteration"] == idx
                for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
                    assert data[key] >= 1, (idx, key, data[key])
                overlap = data["backward_compute_comm_overlap_time"]
                assert data["backward_compute_time"] >= overlap
                assert data["backward_comm_time"] >= overlap
            elif idx > 0:
                assert data["iteration"] != idx
        last = rank_result["xgrad"][-1]
        assert last["iteration"] == 18
        assert last["backward_comm_time_end"] >= last["backward_comm_time_start"]
        assert last["backward_comm_time_start"] >= last["backward_compute_time_start"]
        assert last["backward_compute_time_end"] >= last["backward_compute_time_start"]
        assert last["backward_compute_time_start"] >= last["forward_compute_time_start"]
        for key in ("avg_forward_compute_time", "avg_backward_compute_time"):
            assert last[key] >= 1


def _joined(rank: int, world: int) -> dict[str, Any]:
    """Both DDPs trained under ``join()`` with uneven inputs: the logging data before and
    after (PyTorch's join hook sets ``join_uneven_inputs``)."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    out: dict[str, Any] = {}
    for name, wrap in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        ddp = wrap(copy.deepcopy(model))
        before = dict(ddp._get_ddp_logging_data())
        with ddp.join():
            for _ in range(2 + rank):
                ddp(torch.randn(2, 4)).sum().backward()
        after = dict(ddp._get_ddp_logging_data())
        out[name] = [before.get("join_uneven_inputs"), after.get("join_uneven_inputs")]
    return out


def test_join_uneven_inputs_is_logged_as_pytorch_logs_it() -> None:
    for r in spawn(_joined, 2, timeout=60):
        assert r["xgrad"] == r["torch"] == [None, 1]
