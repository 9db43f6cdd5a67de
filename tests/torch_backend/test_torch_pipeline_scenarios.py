"""Pipeline runtime on 3 real gloo ranks, in one spawn: pytree stage inputs/outputs whose
shapes change, a stage that raises and stays alive (every rank names it, the next step
works), ranks that disagree on the schedule (refused on every rank before anything is
sent), and a DAG of stages with skip connections across ranks (fairscale's invocations)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import pytest
from chain import whole_gradients

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

WIDTH, M = 5, 4


class First(nn.Module):
    """x -> a dict: a float tensor with a graph, an integer mask, a constant tensor, a number."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Any) -> Any:
        return {"h": self.fc(x), "mask": (x > 0).long(), "scale": torch.tensor(0.5), "n": 3}


class Pair(NamedTuple):
    """The middle stage's output: a named tuple crosses ranks (torch's JSON structure
    cannot name one; it went as a failed send before)."""

    h: Any
    g: Any


class Middle(nn.Module):
    """dict -> a named tuple of two float tensors with graphs; raises in its 4th forward
    when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gc = nn.Linear(WIDTH, WIDTH)
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, d: Any) -> Any:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise ValueError("boom in the middle stage")
        h = torch.tanh(self.fc(d["h"])) * d["mask"].to(d["h"].dtype) * d["scale"] * d["n"]
        return Pair(h, self.gc(d["h"]))


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: Any) -> Any:
        a, b = pair
        return self.fc(a) + b


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [First().double(), Middle().double(), Last().double()]


def _batch(n: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, WIDTH, generator=g, dtype=torch.float64),
        torch.randn(n, WIDTH, generator=g, dtype=torch.float64),
    )


def _want(n: int, seed: int) -> list[list[Any]]:
    parts = _model()
    x, y = _batch(n, seed)
    out = x
    for p in parts:
        out = p(out)
    nn.functional.mse_loss(out, y).backward()
    return [[p.grad.clone() for p in part.parameters()] for part in parts]


def _err(part: nn.Module, want: list[Any]) -> float:
    return max(
        float((p.grad - w).abs().max()) for p, w in zip(part.parameters(), want, strict=True)
    )


class Join(nn.Module):
    """Takes a tuple of earlier outputs (a skip connection): tanh(fc(a) + b)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: Any) -> Any:
        a, b = pair
        return torch.tanh(self.fc(a) + b)


# Stage 0 (rank 0) feeds stages 1 and 2 (ranks 1, 2); stage 3 (rank 0 again) joins 2 and 1.
DAG_LOCATIONS = [(0, 0), (1, 0), (2, 0), (0, 1)]
DAG_INPUTS = [(), (0,), (1, 0), (2, 1)]


def _dag_parts() -> list[nn.Module]:
    torch.manual_seed(3)
    first = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    return [first, nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), Join(), Join()]


def _dag(rank: int) -> dict[str, float]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    inv = xp.dag(DAG_LOCATIONS, DAG_INPUTS)
    x, y = _batch(8, 9)
    parts = [p.double() for p in _dag_parts()]
    outs: list[Any] = []
    for k, part in enumerate(parts):
        ins = [outs[i] for i in DAG_INPUTS[k]]
        outs.append(part(x if k == 0 else ins[0] if len(ins) == 1 else tuple(ins)))
    nn.functional.mse_loss(outs[-1], y).backward()
    want = [[p.grad.clone() for p in part.parameters()] for part in parts]
    mine = [k for k, loc in enumerate(DAG_LOCATIONS) if loc[0] == rank]
    errors = {}
    for policy in ("gpipe", "1f1b", "zb"):
        for checkpoint in ("never", "always"):
            for p in parts:
                p.zero_grad(set_to_none=True)
            schedule = xp.from_invocations(inv, M, policy)
            rt = PipelineRuntime(
                schedule,
                [parts[k] for k in mine],
                nn.functional.mse_loss,
                invocations=inv,
                checkpoint=checkpoint,
                timeout=30,
            )
            rt.step(x if rank == 0 else None, y if rank == 0 else None)
            errors[f"{policy}/{checkpoint}"] = max(_err(parts[k], want[k]) for k in mine)
    return errors


class Switch(nn.Module):
    """A stage whose graph depends on its microbatch: the activation is scaled by a
    parameter on some microbatches and by a buffer on others (same node types and edge
    counts either way), so the split backward's W plan must tell the graphs apart."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.w = nn.Parameter(torch.randn(WIDTH))
        self.register_buffer("b", torch.randn(WIDTH))

    def forward(self, x: Any) -> Any:
        return torch.tanh(self.fc(x)) * (self.w if float(x[0, 0]) > 0 else self.b)


def _switched(rank: int, world: int) -> dict[str, float]:
    """Zero-bubble schedules over :class:`Switch` stages equal the unpipelined model."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    errors = {}
    for name in ("zb_h1", "zbv"):
        schedule = xp.make(name, world, M)
        torch.manual_seed(4)
        parts = [Switch().double() for _ in schedule.placement]
        x, y = _batch(8, 10)
        for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):  # the reference, per microbatch
            out = xs
            for part in parts:
                out = part(out)
            (nn.functional.mse_loss(out, ys) / M).backward()
        want = [[p.grad for p in part.parameters()] for part in parts]  # None: unused
        mine = [k for k, r in enumerate(schedule.placement) if r == rank]
        for part in parts:
            part.zero_grad(set_to_none=True)
        rt = PipelineRuntime(schedule, [parts[k] for k in mine], nn.functional.mse_loss, timeout=30)
        last = schedule.placement[-1]
        rt.step(x if rank == schedule.placement[0] else None, y if rank == last else None)
        for k in mine:
            for p, w in zip(parts[k].parameters(), want[k], strict=True):
                gap = 0.0 if p.grad is None and w is None else float("inf")
                if p.grad is not None and w is not None:
                    gap = float((p.grad - w).abs().max())
                errors[name] = max(errors.get(name, 0.0), gap)
        errors[f"{name}/w used"] = sum(part.w.grad is not None for part in parts)
    return errors


def _torch_csv(rank: int, world: int, path: str) -> dict[str, float]:
    """torch's own lowering of its schedules (``_dump_csv`` with comms: UNSHARD, RESHARD,
    REDUCE_GRAD, OVERLAP_F_B), read back and run by xgrad's runtime: gradients as whole."""
    import logging
    import types

    from torch.distributed.pipelining import schedules

    from xgrad.torch_backend.pipeline import PipelineRuntime

    errors = {}
    for cls in ("ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        m = 2 * world
        stand_in = [
            types.SimpleNamespace(
                group_size=world, group_rank=0, num_stages=2 * world, stage_index=k, submod=None
            )
            for k in range(2)
        ]
        logging.disable(logging.WARNING)
        try:
            getattr(schedules, cls)(stand_in, m)._dump_csv(f"{path}.{cls}.{rank}")
        finally:
            logging.disable(logging.NOTSET)
        schedule = xp.load_csv(f"{path}.{cls}.{rank}")
        torch.manual_seed(5)
        parts = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(6)]
        x, y = _batch(2 * m, 10)
        want = whole_gradients(parts, x, y)
        mine = schedule.stages_of(rank)
        rt = PipelineRuntime(schedule, [parts[k] for k in mine], nn.functional.mse_loss)
        first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
        rt.step(x if first else None, y if last else None)
        errors[cls] = max(_err(parts[k], want[k]) for k in mine)
    return errors


def _scenario(rank: int, world: int, path: str) -> dict[str, Any]:
    from xgrad.failure import RankError
    from xgrad.torch_backend.pipeline import PipelineRuntime

    out: dict[str, Any] = {}
    part = _model()[rank]
    schedule = xp.one_f_one_b(world, M)
    rt = PipelineRuntime(schedule, [part], nn.functional.mse_loss, checkpoint="never", timeout=30)

    def step(n: int, seed: int) -> Any:
        x, y = _batch(n, seed)
        part.zero_grad(set_to_none=True)
        if isinstance(part, Middle):
            part.calls = 0
        return rt.step(x if rank == 0 else None, y if rank == world - 1 else None)

    # Pytrees, and shapes that change from step to step (8 then 12 rows).
    for n, seed in ((8, 1), (12, 2)):
        step(n, seed)
        out[f"ok{n}"] = _err(part, _want(n, seed)[rank])
    # The same with every message's leaves sent apart from its header (as large ones are).
    from xgrad.torch_backend import pipeline_frame

    pipeline_frame.PACK_LIMIT = 0
    for n, seed in ((8, 11), (12, 12)):
        step(n, seed)
        out[f"apart{n}"] = _err(part, _want(n, seed)[rank])
    pipeline_frame.PACK_LIMIT = 1 << 20
    # The middle stage raises in its fourth forward (1F3) and stays alive.
    if isinstance(part, Middle):
        part.fail_at = 4
    try:
        step(8, 3)
        out["error"] = None
    except RankError as exc:
        out["error"] = (str(exc), exc.rank, time.time())
    if isinstance(part, Middle):
        part.fail_at = None
    # The next steps work, with the right gradients.
    for n, seed in ((8, 4), (4, 5)):
        step(n, seed)
        out[f"after{n}"] = _err(part, _want(n, seed)[rank])
    # Ranks that run different schedules are refused on every rank, before any send.
    other = xp.gpipe(world, M) if rank == 2 else schedule
    bad = PipelineRuntime(other, [part], nn.functional.mse_loss, timeout=30)
    try:
        x, y = _batch(8, 6)
        bad.step(x if rank == 0 else None, y if rank == world - 1 else None)
        out["disagree"] = None
    except ValueError as exc:
        out["disagree"] = str(exc)
    # ... and the good runtime still works afterwards.
    step(8, 7)
    out["last"] = _err(part, _want(8, 7)[rank])
    out["dag"] = _dag(rank)
    out["switched"] = _switched(rank, world)
    out["torch_csv"] = _torch_csv(rank, world, path)
    # Sent outputs are freed once sent even without checkpointing (their gradient edges keep
    # their graph): what a stage holds is then what checkpointing holds, its inputs.
    for checkpoint in ("never", "always"):
        held = PipelineRuntime(
            xp.gpipe(world, M), [part], nn.functional.mse_loss, checkpoint=checkpoint, timeout=30
        )
        x, y = _batch(8, 8)
        part.zero_grad(set_to_none=True)
        held.step(x if rank == 0 else None, y if rank == world - 1 else None)
        out[f"held_{checkpoint}"] = held.peak_held_bytes
    return out


def test_pytrees_failure_agreement_dag_and_torch_csv(tmp_path: Any) -> None:
    results = spawn(_scenario, 3, args=(str(tmp_path / "torch"),), timeout=150)
    for rank, res in enumerate(results):
        for key in ("ok8", "ok12", "apart8", "apart12", "after8", "after4", "last"):
            assert res[key] <= 1e-12, (rank, key, res[key])
        message, origin, _ = res["error"]
        assert message.startswith("rank 1: 1F3 failed: ValueError: boom in the middle stage"), (
            rank,
            message,
        )
        assert origin == 1
        assert "the ranks disagree on the pipeline schedule" in res["disagree"]
        assert "rank 2 differ from rank 0" in res["disagree"]
        assert "ranks 0, 1 have" in res["disagree"] and "rank 2 has" in res["disagree"]
        if rank < 2:  # stages that send: their sent outputs are not held
            assert 0 < res["held_never"] <= res["held_always"], res
        assert sorted(res["torch_csv"]) == [
            "ScheduleDualPipeV",
            "ScheduleInterleaved1F1B",
            "ScheduleZBVZeroBubble",
        ]
        for key, err in res["torch_csv"].items():
            assert err <= 1e-12, (rank, key, err)
        assert len(res["dag"]) == 6
        for name in ("zb_h1", "zbv"):
            assert res["switched"][name] <= 1e-12, (rank, name, res["switched"])
            assert res["switched"][f"{name}/w used"] > 0  # some stage took the parameter
        for key, err in res["dag"].items():
            assert err <= 1e-12, (rank, key, err)
    raised = [res["error"][2] for res in results]
    # Every rank raised within 2 s of the failing one (measured, same machine clock).
    assert max(raised) - min(raised) <= 2.0, raised
