"""PyTorch's own DDP tests (``distributed_test.py``), on gloo and the CPU, side by side.

Each scenario below is one of PyTorch 2.13's DDP tests (most of them need two GPUs
there), run on xgrad's DDP and on PyTorch's in the same processes: the same gradients,
the same error at the same moment with PyTorch's words (its tests look for them), the
error kept in ``_get_ddp_logging_data()``, and the reducer's private views those tests
read (``_ddp_graph_static``, ``_get_local_used_map``). Where PyTorch's DDP stays broken
after an error, xgrad's next step works: checked for xgrad only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from xgrad.torch_backend.spawn import spawn


class ToyModel(nn.Module):
    """``test_ddp_unused_params_rebuild_buckets_exception``'s: ``net2`` never used."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10, bias=False)
        self.net2 = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net1(x)


class ControlFlow(nn.Module):
    """``test_ddp_control_flow_different_across_ranks``'s: ``lin2`` used on rank 1 for ones."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.equal(x, torch.ones_like(x)) and self.rank == 1:
            return self.lin2(F.relu(self.lin1(x)))
        return F.relu(self.lin1(x))


class Square(nn.Module):
    """``test_ddp_create_graph``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2)


@dataclass
class Hidden:
    """An output DDP cannot look into: its tensors are not searched."""

    used: torch.Tensor
    unused: torch.Tensor


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor, hidden: bool = False, use_b: bool = True) -> Any:
        if hidden:
            return Hidden(self.a(x), self.b(x))
        return self.b(self.a(x)) if use_b else self.a(x)


class SimulateError(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated")


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.error = True
        self.fc1 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(SimulateError.apply(x) if self.error else x)


def _logged(ddp: Any, text: str) -> bool:
    """PyTorch's ``verify_ddp_error_logged``: the error is in the logging data."""
    data = ddp._get_ddp_logging_data()
    return data.get("has_error") == 1 and text in data.get("error", "")


def _raised_later(ddp: Any, model: nn.Module, steps: list[Any]) -> dict[str, Any]:
    """Run ``steps`` (each a forward's arguments); record at which step and part
    something raised, what, and whether it was logged; then one more step."""
    out: dict[str, Any] = {"error": None}
    for i, args in enumerate(steps):
        part = "forward"
        try:
            y = ddp(*args)
            part = "backward"
            (y.used if isinstance(y, Hidden) else y).sum().backward()
        except RuntimeError as exc:
            out |= {"error": str(exc), "at": (i, part), "logged": _logged(ddp, str(exc))}
            break
    return out


def _scenarios(rank: int, world: int, level: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    results: dict[str, Any] = {}
    for name, cls in (("xgrad", DistributedDataParallel), ("torch", TorchDDP)):
        out: dict[str, Any] = {}
        torch.manual_seed(0)
        x = torch.rand(1, 10)

        # test_ddp_create_graph: gradients that require grad, accumulated over 6 steps.
        ddp = cls(Square())
        grads = []
        for _ in range(6):
            ddp().backward(create_graph=True)
            grads.append((ddp.module.p.grad.item(), ddp.module.p.grad.requires_grad))
        out["create_graph"] = grads

        # test_ddp_unused_params_rebuild_buckets_exception: the pass ends, the next
        # forward raises; xgrad's step after that works.
        ddp = cls(ToyModel())
        out["unused"] = _raised_later(ddp, ddp.module, [(x,), (x,)])
        if name == "xgrad":
            ddp(x).sum().backward()  # net2 still unused: the pass ends again, no error

        # The same with a static graph whose parameter goes unused after the first step,
        # and with find_unused_parameters when DDP cannot see into the output.
        ddp = cls(TwoOut(), static_graph=True)
        out["static"] = _raised_later(ddp, ddp.module, [(x,), (x, False, False), (x,)])
        ddp = cls(TwoOut(), find_unused_parameters=True)
        out["hidden"] = _raised_later(ddp, ddp.module, [(x, True), (x, True)])

        # test_ddp_control_flow_different_across_ranks: the summed used map, the graph
        # found not static; then the error without find_unused_parameters.
        ones, rand = torch.ones(20, 10), torch.randn(20, 10)
        ddp = cls(ControlFlow(rank), find_unused_parameters=True)
        maps = []
        for i in range(6):
            ddp(rand if i % 2 == 0 else ones).sum().backward()
            maps.append(ddp.reducer._get_local_used_map().tolist())
        out["used_maps"] = maps
        out["graph_static"] = ddp.reducer._ddp_graph_static()
        ddp = cls(ControlFlow(rank))
        out["control_flow"] = _raised_later(ddp, ddp.module, [(rand,), (rand,)])

        # test_detect_ddp_is_actually_static: the same unused set every step.
        ddp = cls(TwoOut(), find_unused_parameters=True)
        for _ in range(4):
            ddp(x, False, False).sum().backward()
        out["actually_static"] = ddp.reducer._ddp_graph_static()

        # test_static_graph_api_cpu and test_ddp_python_error_logged.
        ddp = cls(TwoOut())
        ddp(x).sum().backward()
        try:
            ddp._set_static_graph()
        except RuntimeError as exc:
            out["late_static"] = ("should be called before training loop starts" in str(exc),)
            out["late_static"] += (_logged(ddp, "should be called before training loop starts"),)
        try:
            ddp.register_comm_hook({}, {})  # type: ignore[arg-type]
        except TypeError:
            out["hook_not_callable"] = _logged(ddp, "must be callable")

        # test_ddp_remove_autograd_hooks: a failed backward, the hooks removed, a second
        # DDP on the same module.
        model = Failing()
        first = cls(model)
        try:
            first(torch.rand(10, 10, requires_grad=True)).sum().backward()
        except RuntimeError:
            out["failing"] = "raised"
        first._remove_autograd_hooks()
        model.error = False
        second = cls(model)
        second(torch.rand(10, 10)).sum().backward()
        out["second"] = [p.grad is not None for p in model.parameters()]
        results[name] = out
    return results


@pytest.fixture(scope="module", params=["OFF", "INFO"])
def both(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return spawn(_scenarios, 2, args=(request.param,), timeout=180)


@pytest.mark.parametrize(
    "case",
    [
        "create_graph",
        "unused",
        "static",
        "hidden",
        "used_maps",
        "graph_static",
        "control_flow",
        "actually_static",
        "late_static",
        "hook_not_callable",
        "failing",
        "second",
    ],
)
def test_xgrad_does_what_pytorchs_ddp_does(both: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(both):
        assert result["xgrad"][case] == result["torch"][case], (rank, case)


def test_the_scenarios_test_something(both: list[dict[str, Any]]) -> None:
    """The side-by-side comparison above would pass on two DDPs that did nothing."""
    for rank, result in enumerate(both):
        ours = result["xgrad"]
        assert [g for g, _ in ours["create_graph"]] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
        for case, part in (("unused", 1), ("static", 2), ("hidden", 1), ("control_flow", 1)):
            got = ours[case]
            assert got["at"] == (part, "forward") and got["logged"], (case, got)
            assert got["error"].startswith("Expected to have finished reduction in the prior")
            assert f"did not receive grad for rank {rank}: " in got["error"]
        assert ours["used_maps"] == [[2, 0], [2, 1]] * 3
        # lin2 goes unused on rank 0 at every step, on rank 1 at every other one.
        assert ours["graph_static"] is (rank == 0) and ours["actually_static"] is True
        assert ours["late_static"] == (True, True) and ours["hook_not_callable"] is True
        assert ours["failing"] == "raised" and ours["second"] == [True, True]
