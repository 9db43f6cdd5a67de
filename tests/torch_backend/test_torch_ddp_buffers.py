"""Module buffers and PyTorch's remaining DDP attributes, against PyTorch's DDP on gloo.

One spawned 2-process group runs each scenario on both DDPs: two forward passes before one
backward pass with a buffer the graph saved (PyTorch hides the buffer broadcast from
autograd), a buffer the module reassigned (synced from rank 0, not left differing), and
a buffer comm hook that sums buffers, registered before and after the forward pass (run
instead of the broadcast, its futures awaited by the end of the backward pass or at once
without one). Then the attributes PyTorch's code reads, and the reducer-facing methods
(an unfinished reduction raises at the end of xgrad's backward pass already), and
``_update_process_group`` and ``register_comm_hook`` between steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from xgrad.torch_backend.spawn import spawn


class Scaled(nn.Module):
    """A linear layer times a buffer: the buffer is saved for the backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _summing_hook(state: Any, buffers: dict[str, torch.Tensor]) -> list[Any]:
    return [dist.all_reduce(b, async_op=True).get_future() for b in buffers.values()]


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.nn.parallel.distributed import _BufferCommHookLocation as Where

    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, Any] = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    for impl, cls in (("torch", TorchDDP), ("xgrad", DistributedDataParallel)):
        res: dict[str, Any] = {}
        torch.manual_seed(0)
        ddp = cls(Scaled())
        (ddp(x).sum() + ddp(x).sum()).backward()  # the second broadcast bumps no version
        res["two_forwards"] = ddp.module.fc.weight.grad.tolist()

        module = Scaled()
        ddp = cls(module)
        module.scale = torch.full((4,), rank + 2.0)  # reassigned, differently on each rank
        ddp(x).sum().backward()
        res["reassigned"] = module.scale.tolist()

        for where in (Where.POST_FORWARD, Where.PRE_FORWARD):
            module = Scaled()
            ddp = cls(module)
            module.scale.fill_(rank + 1.0)
            ddp._register_buffer_comm_hook(None, _summing_hook, where)
            ddp(x).sum().backward()
            res[f"hook_{where.name}"] = module.scale.tolist()
        with torch.no_grad():  # no backward pass: the hook's futures are waited for at once
            ddp(x)
        dist.barrier()
        res["hook_no_grad"] = module.scale.tolist()

        ddp = cls(Scaled(), bucket_cap_mb=2)
        res["attributes"] = [
            ddp.broadcast_bucket_size,
            ddp.bucket_bytes_cap,
            ddp.bucket_bytes_cap_default,
            ddp.bucket_bytes_cap_list,
            ddp.is_multi_device_module,
            ddp.use_side_stream_for_tensor_copies,
            sorted(ddp.named_module_buffers),
        ]
        ddp = cls(Scaled(), bucket_cap_mb_list=[1, 3])
        res["list_attributes"] = [
            ddp.bucket_bytes_cap,
            ddp.bucket_bytes_cap_default,
            ddp.bucket_bytes_cap_list,
        ]
        default = cls(Scaled())
        res["default_attributes"] = [
            default.bucket_bytes_cap_default,
            default.bucket_bytes_cap_list,
        ]

        ddp = cls(Scaled())
        ddp(x).sum().backward()
        ddp._check_reducer_finalized()  # a finished pass: no error on either
        res["finalized"] = True
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        ddp = cls(model)
        grads = []
        for step in range(4):  # the group replaced between steps, the buckets rebuilt on it
            if step == 2:
                ddp._update_process_group(dist.new_group([0, 1]))
            model.zero_grad()
            (ddp(x) * (step + 1)).sum().backward()
            grads.append(model.weight.grad.tolist())
        res["updated_group"] = grads

        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        ddp = cls(model)
        grads = []
        for step in range(3):  # a comm hook registered between iterations
            if step == 1:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            model.zero_grad()
            (ddp(x) * (step + 1)).sum().backward()
            grads.append(model.weight.grad.tolist())
        res["late_hook"] = grads
        for name, kwargs in (("cap0", {"bucket_cap_mb": 0}), ("out0", {"output_device": 0})):
            torch.manual_seed(0)
            model = nn.Linear(4, 4)
            ddp = cls(model, **kwargs)  # PyTorch takes both (a bucket per parameter; 0 falsy)
            (ddp(x) * 3).sum().backward()
            res[name] = model.weight.grad.tolist()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(Scaled(), check_reduction=True)
            cls(Scaled(), static_graph=True, find_unused_parameters=True)._set_static_graph()
        res["warnings"] = sorted(
            (w.category.__name__, str(w.message)[:70])
            for w in caught
            if w.category in (FutureWarning, UserWarning)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(Scaled(), broadcast_buffers=False)
            cls(Scaled(), broadcast_buffers=False, forward_sync_buffers=True)
        res["buffer_warnings"] = [str(w.message) for w in caught if w.category is FutureWarning]
        try:
            cls(nn.SyncBatchNorm(4))
            res["syncbn"] = "no error"
        except ValueError as exc:
            res["syncbn"] = str(exc)
        try:
            ddp._set_ddp_runtime_logging_sample_rate(0)
            res["rate"] = "no error"
        except (ValueError, RuntimeError) as exc:
            res["rate"] = str(exc).split(",")[0]
        out[impl] = res
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_scenarios, 2, timeout=180)


@pytest.mark.parametrize(
    "key",
    [
        "two_forwards",
        "reassigned",
        "hook_POST_FORWARD",
        "hook_PRE_FORWARD",
        "hook_no_grad",
        "attributes",
        "list_attributes",
        "default_attributes",
        "finalized",
        "updated_group",
        "late_hook",
        "cap0",
        "out0",
        "syncbn",
        "warnings",
        "buffer_warnings",
    ],
)
def test_matches_pytorch(results: list[dict[str, Any]], key: str) -> None:
    for rank in range(2):
        assert results[rank]["xgrad"][key] == results[rank]["torch"][key], (rank, key)


def test_buffers_end_equal_on_every_rank(results: list[dict[str, Any]]) -> None:
    # Not only PyTorch's: the values that make each scenario fail when left undone.
    assert results[0]["xgrad"]["reassigned"] == results[1]["xgrad"]["reassigned"] == [2.0] * 4
    assert results[0]["xgrad"]["hook_POST_FORWARD"] == [3.0] * 4  # 1 + 2, summed
    assert results[1]["xgrad"]["hook_no_grad"] == [6.0] * 4  # 3 + 3, summed once more
    kinds = [kind for kind, _ in results[0]["xgrad"]["warnings"]]
    assert kinds == ["FutureWarning", "UserWarning", "UserWarning"]  # check_reduction, twice set


def test_logging_sample_rate_is_checked(results: list[dict[str, Any]]) -> None:
    rate = results[0]["xgrad"]["rate"]
    assert rate == "DDP runtime logging sample rate should be equal or greater than 1"
    assert rate in results[0]["torch"]["rate"]


def test_methods_without_a_counterpart_say_so() -> None:
    from xgrad.torch_backend.ddp_compat import CompatDDP

    compat = CompatDDP()
    with pytest.raises(NotImplementedError, match="_set_sparse_metadata"):
        compat._set_sparse_metadata({})
    with pytest.raises(NotImplementedError, match="join"):
        compat._match_all_reduce_for_bwd_pass()
    with pytest.raises(NotImplementedError, match="join"):
        compat._match_unused_params_allreduce()
