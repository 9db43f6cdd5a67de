"""A stage input that gets no gradient: the parameters behind it keep ``grad is None``.

In the unpipelined model a parameter reached only through an output the later stages
ignore gets no gradient at all (``.grad`` stays ``None``, so optimizers skip it and weight
decay or momentum do not move it). PyTorch's pipelining sends zeros for a missing input
gradient (``get_bwd_send_ops``), so there that parameter gets a zero gradient; xgrad's
runtime sends it as none (marked in the gradient header's code), and the upstream stage
leaves that output out of its backward, as the unpipelined model does. A first stage whose
output needs no gradient (frozen, parameter-free) runs the split-backward schedules: its
W pass has nothing to do.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

W, M = 4, 2


class Part(nn.Module):
    """Stage 0 sends ``(h, h * v)``; stage 1 uses ``h`` only, so ``v`` gets no gradient."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.v = nn.Parameter(torch.ones(W))
        self.first = first

    def forward(self, t: Any) -> Any:
        h = torch.tanh(self.fc(t if self.first else t[0]))
        return (h, h * self.v) if self.first else h


def _run(rank: int, world: int) -> list[tuple[str, bool, bool, float]]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    parts = [Part(first=True).double(), Part(first=False).double()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
    y = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
    ref = [Part(first=True).double(), Part(first=False).double()]
    for r, p in zip(ref, parts, strict=True):
        r.load_state_dict(p.state_dict())
    nn.functional.mse_loss(ref[1](ref[0](x)), y).backward()
    rt = PipelineRuntime(xp.make("1f1b", 2, M), [parts[rank]], nn.functional.mse_loss, timeout=20)
    rt.step(x if rank == 0 else None, y if rank == 1 else None)
    out = []
    for (name, p), q in zip(parts[rank].named_parameters(), ref[rank].parameters(), strict=True):
        diff = 0.0 if p.grad is None or q.grad is None else float((p.grad - q.grad).abs().max())
        out.append((name, p.grad is None, q.grad is None, diff))
    return out


def test_a_parameter_behind_an_ignored_output_gets_no_gradient() -> None:
    per_rank = spawn(_run, 2, timeout=60)
    for rank, rows in enumerate(per_rank):
        for name, none, want_none, diff in rows:
            assert diff < 1e-12, (rank, name, diff)
            assert none == want_none, (rank, name, "None" if want_none else "a gradient")


class Chain(nn.Module):
    """Stage k sends ``(h, h * v)``. Its input use: ``"first"`` the batch, ``"part"`` only
    ``t[0]`` (``t[1]`` gets none), ``"zero"`` ``t[0] + 0 * t[1]`` (``t[1]`` gets a zero
    gradient, which must stay zeros), ``"none"`` no input at all (nothing upstream gets one)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.v = nn.Parameter(torch.ones(W))
        self.mode = mode

    def forward(self, t: Any) -> Any:
        x = {"first": lambda: t, "part": lambda: t[0], "zero": lambda: t[0] + 0 * t[1]}.get(
            self.mode, lambda: torch.ones(t[0].shape, dtype=t[0].dtype)
        )()
        h = torch.tanh(self.fc(x))
        return h, h * self.v


def _chain_loss(y: Any, target: Any) -> Any:
    return nn.functional.mse_loss(y[0], target)


#: (schedule on 2 ranks, checkpoint, each stage's input use): split I/W passes with V placement
#: (zbv: stages 1 and 2 hand over on rank 1, no wire: a none passes there), plain B looped,
#: a stage ignoring its whole input (no backward upstream), and recomputed forwards.
CASES = [
    ("zbv", "never", ("first", "zero", "part", "part")),
    ("zbv", "always", ("first", "part", "zero", "part")),
    ("zbv", "never", ("first", "part", "none", "part")),
    ("interleaved_1f1b", "except_last", ("first", "part", "part", "zero")),
    ("zb_h1", "never", ("first", "none")),
    ("zb_h1", "always", ("first", "none")),
]


def _run_cases(rank: int, world: int) -> list[tuple[int, str, bool, bool, float]]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    out = []
    for case, (name, checkpoint, modes) in enumerate(CASES):
        schedule = xp.make(name, 2, M)
        assert schedule.num_stages == len(modes)
        torch.manual_seed(case)
        parts = [Chain(mode).double() for mode in modes]
        ref = [Chain(mode).double() for mode in modes]
        for r, p in zip(ref, parts, strict=True):
            r.load_state_dict(p.state_dict())
        g = torch.Generator().manual_seed(case)
        x = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
        y = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
        h = x
        for r in ref:
            h = r(h)
        _chain_loss(h, y).backward()
        mine = schedule.stages_of(rank)
        rt = PipelineRuntime(
            schedule, [parts[k] for k in mine], _chain_loss, checkpoint=checkpoint, timeout=20
        )
        first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
        for _ in range(2):  # the second step runs on what the first learnt (frames, plans)
            for p in parts:
                p.zero_grad(set_to_none=True)
            rt.step(x if first else None, y if last else None)
        for k in mine:
            for (pname, p), q in zip(parts[k].named_parameters(), ref[k].parameters(), strict=True):
                diff = (
                    0.0
                    if p.grad is None or q.grad is None
                    else float((p.grad - q.grad).abs().max())
                )
                out.append((case, f"stage {k} {pname}", p.grad is None, q.grad is None, diff))
    return out


def _with_ddp(rank: int) -> tuple[list[float | None], list[float]]:
    """Stages wrapped in xgrad's DDP (one-rank data-parallel groups): its reducer waits for
    every parameter the stage's forward reached, so the parameter behind the ignored output
    gets zeros there (the documented fallback), and two steps run."""
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    dp = [dist.new_group([0]), dist.new_group([1])][rank]
    torch.manual_seed(0)
    part = Part(first=rank == 0).double()
    ddp = DistributedDataParallel(part, process_group=dp, timeout=20, find_unused_parameters=True)
    rt = PipelineRuntime(
        xp.make("1f1b", 2, M),
        [ddp],
        nn.functional.mse_loss,
        timeout=20,
        no_sync=lambda i: ddp.no_sync(),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
    y = torch.randn(2 * M, W, generator=g, dtype=torch.float64)
    for _ in range(2):
        part.zero_grad(set_to_none=True)
        rt.step(x if rank == 0 else None, y if rank == 1 else None)
    v = None if part.v.grad is None else float(part.v.grad.abs().max())
    return [v], [float(p.grad.abs().max()) for p in part.fc.parameters() if p.grad is not None]


def _run_all(rank: int, world: int) -> tuple[list[Any], Any]:
    return _run_cases(rank, world), _with_ddp(rank)


def test_none_and_zero_gradients_travel_as_such_in_split_and_v_schedules() -> None:
    results = spawn(_run_all, 2, timeout=90)
    per_rank = [rows for rows, _ in results]
    # DDP: stage 0's v gets zeros (its reducer finishes), stage 1's v is unused in its forward
    assert [ddp[0] for _, ddp in results] == [[0.0], [None]]
    assert all(len(ddp[1]) == 2 and min(ddp[1]) > 0 for _, ddp in results)
    seen = {(case, none) for rows in per_rank for case, _, none, _, _ in rows}
    # every case has parameters with a gradient; the chains give some none
    assert {case for case, none in seen if not none} == set(range(len(CASES)))
    assert {case for case, none in seen if none} == set(range(len(CASES)))
    for rows in per_rank:
        for case, name, none, want_none, diff in rows:
            assert diff < 1e-12, (CASES[case], name, diff)
            assert none == want_none, (CASES[case], name, "None" if want_none else "a gradient")


def _inert_first(rank: int, world: int, kind: str) -> list[str]:
    """A first stage whose output needs no gradient under the split-backward schedules:
    their W pass has nothing to do (it failed with "runs without its I pass's graph")."""
    import copy

    from xgrad.torch_backend.pipeline import PipelineRuntime

    wrong = []
    m = 4
    for name in ("zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev"):
        for checkpoint in ("never", "except_last"):
            schedule = xp.make(name, 2, m)
            torch.manual_seed(0)
            parts = [nn.Linear(W, W).double() for _ in range(schedule.num_stages)]
            if kind == "frozen":
                parts[0].requires_grad_(False)
            else:
                parts[0] = nn.Tanh()
            model = [copy.deepcopy(p) for p in parts]
            g = torch.Generator().manual_seed(1)
            x = torch.randn(2 * m, W, generator=g, dtype=torch.float64)
            y = torch.randn(2 * m, W, generator=g, dtype=torch.float64)
            nn.functional.mse_loss(nn.Sequential(*parts)(x), y).backward()
            mine = [s for s in range(schedule.num_stages) if schedule.placement[s] == rank]
            rt = PipelineRuntime(
                schedule,
                [model[s] for s in mine],
                nn.functional.mse_loss,
                checkpoint=checkpoint,
                timeout=20,
            )
            last = schedule.placement[-1] == rank
            rt.step(x if rank == 0 else None, y if last else None)
            for s in mine:
                for p, q in zip(model[s].parameters(), parts[s].parameters(), strict=True):
                    if (p.grad is None) != (q.grad is None) or (
                        p.grad is not None and float((p.grad - q.grad).abs().max()) >= 1e-12
                    ):
                        wrong.append(f"{name} {checkpoint} stage {s}")
    return wrong


@pytest.mark.parametrize("kind", ["frozen", "parameter_free"])
def test_a_first_stage_whose_output_needs_no_gradient_runs_split_backward(kind: str) -> None:
    assert spawn(_inert_first, 2, args=(kind,), timeout=120) == [[], []]
