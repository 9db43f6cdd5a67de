"""``join()`` with uneven inputs: gradients and final models equal to PyTorch's DDP under join.

One spawned group per world size (2 and 3) runs every scenario; rank ``r`` has ``3 + r``
batches, so ranks run out at different iterations. Each scenario trains xgrad's DDP and
PyTorch's DDP on the same model, seeds and data, inside their join contexts, and returns
every step's gradients and the final parameters.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class Net(nn.Module):
    """``c`` unused when ``use_c`` is off; a BatchNorm buffer that join must keep in step."""

    def __init__(self, use_c: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.norm = nn.BatchNorm1d(7)
        self.b = nn.Linear(7, 2)
        self.c = nn.Linear(7, 2)
        self.use_c = use_c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.a(x)))
        return self.b(h) + self.c(h) if self.use_c else self.b(h)


class SparseNet(nn.Module):
    """``Net`` behind an embedding; ``sparse=True`` gives it a sparse gradient (own bucket)."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 5, sparse=sparse)
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, 0].abs() * 10).long() % 10  # repeats within a batch, differs per rank
        return self.net(x + self.emb(idx))  # type: ignore[no-any-return]


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 5, generator=g) for _ in range(3 + rank)]


def _train(
    ddp: nn.Module, module: nn.Module, ctx: Any, rank: int, changing: bool = False
) -> dict[str, Any]:
    """``changing``: ``c`` used on every other step, not on the same steps on every rank,
    and SGD with momentum (a zero gradient moves a parameter, a ``None`` one does not)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9 if changing else 0.0)
    grads = []
    with ctx:
        for step, x in enumerate(_batches(rank)):
            if changing:
                module.use_c = (rank + step) % 2 == 1
            opt.zero_grad()
            ddp(x).square().sum().backward()
            grads.append(
                {
                    n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone().numpy()
                    for n, p in module.named_parameters()
                    if p.grad is not None
                }
            )
            opt.step()
    final = {n: p.detach().clone().numpy() for n, p in module.state_dict().items()}
    return {"grads": grads, "final": final}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, Any] = {}
    cases = {
        "plain": ({}, {}, True),
        "unused": ({"find_unused_parameters": True}, {}, False),
        # Unused sets that change: a joined rank re-sends its last summed used map, as
        # PyTorch's does, so what a rank used in its last step keeps a (zero) gradient.
        "unused_changing": ({"find_unused_parameters": True}, {}, True),
        "effective_world": ({}, {"divide_by_initial_world_size": False}, True),
        # After its first iteration a static graph sums no used-parameter map: a joined
        # rank must not either, or the collectives of the ranks still training mismatch.
        "static": ({"static_graph": True}, {}, False),
    }
    if world > 2:  # the options are world-size independent: 2 ranks cover them
        cases = {k: v for k, v in cases.items() if k not in ("effective_world", "static")}
    for case, (kw, join_kw, use_c) in cases.items():
        torch.manual_seed(0)
        base = Net(use_c)
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        ours = DistributedDataParallel(m1, **kw)
        theirs = TorchDDP(m2, **kw)
        changing = case == "unused_changing"
        if changing:  # PyTorch's context manager over both
            ctxs = (TorchJoin([ours]), TorchJoin([theirs]))
        else:
            ctxs = (ours.join(**join_kw), theirs.join(**join_kw))
        out[case] = {
            "xgrad": _train(ours, m1, ctxs[0], rank, changing),
            "torch": _train(theirs, m2, ctxs[1], rank, changing),
        }
    # A sparse gradient: a joined rank offers an empty one to the sparse bucket's
    # reduction. PyTorch's DDP cannot be the reference (its joined rank offers a dense
    # zero bucket and the ranks hang): its DDP on the same model with a dense embedding is.
    torch.manual_seed(0)
    base = SparseNet(sparse=True)
    m1 = copy.deepcopy(base)
    m2 = SparseNet(sparse=False)
    m2.load_state_dict(base.state_dict())
    ours, theirs = DistributedDataParallel(m1, timeout=30), TorchDDP(m2)
    out["sparse"] = {
        "xgrad": _train(ours, m1, ours.join(), rank),
        "torch": _train(theirs, m2, theirs.join(), rank),
    }
    if world > 2:
        return out
    # PyTorch's own context manager over xgrad's DDP (a Joinable like PyTorch's).
    torch.manual_seed(0)
    m = Net()
    ddp = DistributedDataParallel(m)
    out["torch_join"] = _train(ddp, m, TorchJoin([ddp]), rank)
    # throw_on_early_termination: every rank raises once the first runs out.
    m = Net()
    ddp = DistributedDataParallel(m)
    try:
        _train(ddp, m, ddp.join(throw_on_early_termination=True), rank)
        out["throw"] = "no error"
    except RuntimeError as err:
        out["throw"] = str(err)
    # A comm hook that fails on the rank that joined (in its shadow pass): every rank
    # raises at once, naming it, not at the timeout naming itself.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    m = Net()
    ddp = DistributedDataParallel(m, timeout=20)
    joined = []

    def failing(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if joined and joined[0]:
            raise ValueError("shadow hook failed")
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, failing)
    started = time.monotonic()
    try:
        with ddp.join():
            for x in _batches(rank)[: 1 + 2 * rank]:
                ddp(x).sum().backward()
            joined.append(rank == 0)
        out["joined_hook"] = ("no error", 0.0)
    except RuntimeError as err:
        out["joined_hook"] = (str(err), time.monotonic() - started)
    # delay_all_reduce_named_params under join: refused on every rank when the context is
    # made (before: the joined rank missed the delayed all-reduce and gloo aborted).
    m = Net()
    ddp = DistributedDataParallel(
        m,
        delay_all_reduce_named_params=[("a.weight", m.a.weight)],
        param_to_hook_all_reduce=m.a.bias,
    )
    try:
        with ddp.join():
            for x in _batches(rank):
                ddp(x).sum().backward()
        out["delayed"] = "no error"
    except ValueError as err:
        out["delayed"] = str(err)
    # After join, an ordinary collective on every rank still matches up (no hang).
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    out["after"] = float(t.item())
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, spawn(_scenarios, request.param, timeout=240)


def _close(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str, atol: float | None = 1e-7
) -> None:
    """Equal names, values within ``atol`` (``None``: bit for bit)."""
    assert sorted(a) == sorted(b), what
    for name in a:
        if atol is None:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{what} {name}")
        else:
            np.testing.assert_allclose(
                a[name], b[name], rtol=1e-6, atol=atol, err_msg=f"{what} {name}"
            )


@pytest.mark.parametrize(
    "case", ["plain", "unused", "unused_changing", "effective_world", "static", "sparse"]
)
def test_gradients_and_final_model_equal_pytorchs_under_join(
    world: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    size, results = world
    if case not in results[0]:
        pytest.skip(f"{case} runs at world size 2 only")
    # sparse: the reference's buckets hold the embedding too, so at 3 ranks gloo sums the
    # dense gradients in another order (float32, last bits).
    atol = {"sparse": 1e-6, "unused_changing": None}.get(case, 1e-7)
    for rank, result in enumerate(results):
        ours, theirs = result[case]["xgrad"], result[case]["torch"]
        assert len(ours["grads"]) == 3 + rank
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
            _close(a, b, f"world {size} rank {rank} step {step}", atol)
        _close(ours["final"], theirs["final"], f"world {size} rank {rank} final", atol)
        # Every rank ends with the model of the last rank to join.
        _close(ours["final"], results[-1][case]["xgrad"]["final"], f"rank {rank} vs last")
    if case == "unused":
        assert "c.weight" not in results[0][case]["xgrad"]["grads"][0]
    if case == "unused_changing":
        # The last step: one rank trains, without c; c was used in the joined ranks' last
        # step, so it has a zero gradient (PyTorch's), not none.
        last = results[-1][case]["xgrad"]["grads"][-1]
        assert "c.weight" in last and not np.any(last["c.weight"]), last


def test_pytorchs_join_context_drives_xgrads_ddp(world: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = world
    if "torch_join" not in results[0]:
        pytest.skip("world size 2 only")
    for result in results:
        _close(result["torch_join"]["final"], result["plain"]["torch"]["final"], "Join([ddp])")


def test_throw_on_early_termination_raises_on_every_rank(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    size, results = world
    if "throw" not in results[0]:
        pytest.skip("world size 2 only")
    assert results[0]["throw"] == "Rank 0 exhausted all inputs."
    for result in results[1:]:
        assert "Detected at least one rank that exhausted inputs" in result["throw"]
    assert all(r["after"] == float(size) for r in results)


def test_a_comm_hook_failing_on_the_joined_rank_is_named_on_every_rank_at_once(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = world
    if "joined_hook" not in results[0]:
        pytest.skip("world size 2 only")
    for result in results:
        message, seconds = result["joined_hook"]
        assert message.startswith("rank 0 in comm hook, bucket 0: ValueError: shadow hook failed")
        assert seconds < 10  # the timeout is 20 s


def test_delayed_all_reduce_is_refused_under_join(world: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = world
    if "delayed" not in results[0]:
        pytest.skip("world size 2 only")
    for result in results:
        assert result["delayed"].startswith(
            "join() does not support delay_all_reduce_named_params"
        ), result["delayed"]
