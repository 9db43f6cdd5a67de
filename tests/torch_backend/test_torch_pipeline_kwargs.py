"""The model's own keywords in ``step`` and ``eval``, as torch's pipeline schedules take them.

torch 2.13's ``schedule.step(*args, target=None, ..., **kwargs)`` splits the keywords into
microbatches with the positional arguments (a tensor chunked along dim 0, anything else
given whole to each: ``split_args_kwargs_into_chunks``) and gives each rank's to every
stage that rank runs; its ``eval`` passes them on. xgrad's ``step`` took none (a
``TypeError`` for ``runtime.step(x, mask=m)``). On two gloo ranks, each running torch's
ScheduleGPipe / Schedule1F1B and then xgrad's runtime on the same stages, weights, batch
and keywords: a tensor mask, a non-tensor flag and a scale that requires grad on the
first stage, a tensor shift on the last.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M = 4


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5).double()

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, scale: Any = None, flag: bool = False
    ) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) * mask
        if scale is not None:
            h = h * scale
        return -h if flag else h


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2).double()

    def forward(self, h: torch.Tensor, shift: Any = None) -> torch.Tensor:
        y = self.lin(h)
        return y if shift is None else y + shift


def _part(rank: int) -> nn.Module:
    torch.manual_seed(0)
    parts = [_First(), _Last()]
    return parts[rank]


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"x": draw(8, 3), "y": draw(8, 2), "mask": draw(8, 5), "s": draw(8, 1), "t": draw(8, 2)}


def _calls(rank: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each rank's calls, torch's form: positional arguments and the model's keywords (a
    fresh leaf ``scale`` each, whose gradient is compared)."""
    d = _data()
    if rank == 1:
        return [((), {"shift": d["t"]}), ((), {})]
    positional = ((d["x"],), {"mask": d["mask"], "flag": True})
    positional[1]["scale"] = d["s"].clone().requires_grad_()
    alone = ((), {"x": d["x"], "mask": d["mask"], "scale": d["s"].clone().requires_grad_()})
    return [positional, alone]


def _grads(module: nn.Module, kw: dict[str, Any]) -> list[Any]:
    found = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    scale = kw.get("scale")
    return [*found, None if scale is None else scale.grad]


def _both(rank: int, world: int, name: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from xgrad.torch_backend.pipeline import PipelineRuntime

    y = _data()["y"] if rank == 1 else None
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    theirs_part, ours_part = _part(rank), _part(rank)
    theirs = cls(PipelineStage(theirs_part, rank, 2, torch.device("cpu")), M, loss_fn=nn.MSELoss())
    rt = PipelineRuntime(xp.make(name, 2, M), [ours_part], nn.MSELoss(), timeout=20)
    out: dict[str, Any] = {"torch": [], "ours": []}
    for side, part in (("torch", theirs_part), ("ours", ours_part)):
        for args, kw in _calls(rank):
            losses: list[Any] = []
            if side == "torch":
                got = theirs.step(*args, target=y, losses=losses, **kw)
            else:  # xgrad's one positional input (None: keywords alone), torch's keywords
                got = rt.step(
                    *(args or (None,)), target=y, losses=losses, return_outputs=True, **kw
                )
            out[side].append({"out": got, "losses": losses, "grads": _grads(part, kw)})
        args, kw = _calls(rank)[0]
        evaluate = theirs.eval if side == "torch" else rt.eval
        got = evaluate(*args, target=y, **kw)
        out[side].append({"out": None if got is None else got.detach(), "requires_grad": False})
        out[side][-1]["requires_grad"] = got is not None and got.requires_grad
        out[side].append({"out": evaluate(*args, target=y, return_outputs=False, **kw)})
    return out


def _equal(got: Any, want: Any) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)  # bit for bit
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _equal(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_keywords_reach_the_stages_as_torchs_do(name: str) -> None:
    first, last = spawn(_both, 2, args=(name,), timeout=120)
    for rank in (first, last):
        theirs, ours = rank["torch"], rank["ours"]
        for k in (0, 1):  # step(x, mask=, flag=, scale=), then step(x=, mask=, scale=)
            _equal(ours[k]["losses"], theirs[k]["losses"])
            _equal(ours[k]["out"], theirs[k]["out"])
            _equal(ours[k]["grads"][:-1], theirs[k]["grads"][:-1])
            # torch divides the parameters' gradients by m after the backward, and leaves
            # a keyword's (as an input's) m times the unpipelined model's; xgrad scales
            # each microbatch's loss, and gives the unpipelined model's (exact: m = 4).
            scale = ours[k]["grads"][-1]
            _equal(None if scale is None else scale * M, theirs[k]["grads"][-1])
        assert (ours[0]["grads"][-1] is None) is (rank is last)  # scale's gradient came
        _equal(ours[2]["out"], theirs[2]["out"])  # eval: the same outputs...
        assert theirs[2]["requires_grad"] is (rank is last)  # ...torch's with their graph
        assert ours[2]["requires_grad"] is False
        assert ours[3]["out"] is theirs[3]["out"] is None  # eval(return_outputs=False)
    assert len(last["ours"][0]["losses"]) == M
    # The flag and the shift made a difference (the keywords were not dropped).
    assert not torch.equal(last["ours"][0]["losses"][0], last["ours"][1]["losses"][0])


def _bad(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    d = _data()
    rt = PipelineRuntime(xp.make("1f1b", 2, M), [_part(rank)], nn.MSELoss(), timeout=10)
    y = d["y"] if rank == 1 else None
    good = {"mask": d["mask"]}
    steps: list[tuple[Any, dict[str, Any]]] = [
        (d["x"], {"mask": d["mask"][:6]}),  # the first step (before the private group)
        (d["x"], good),
        (d["x"], {"mask": d["mask"], "scale": torch.tensor(2.0, dtype=torch.float64)}),
        (None, {"flag": True}),  # no input at all: keywords without a tensor
        (d["x"], good),
    ]
    outcome = []
    for x, kw in steps:
        try:
            rt.step(x if rank == 0 else None, target=y, **(kw if rank == 0 else {}))
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
    return outcome


def test_a_bad_keyword_is_refused_naming_it_on_every_rank() -> None:
    """Raised on the rank given it before it sends anything; its peer's step fails naming
    that rank (it does not wait out its timeout), and the next step works. torch raises an
    ``IndexError`` for the 0-dim tensor, and splits a mask of 6 rows into 2, 2, 1, 1 and
    inputs of 8 into 2 each, and pairs them."""
    from ranks import run_ranks

    results, _ = run_ranks(_bad, 2, timeout=60)
    zero, one = results[0][1], results[1][1]
    assert zero == [
        "ValueError: rank 0: keyword 'mask' batch size 6 and inputs batch size 8 split into "
        "microbatches of different rows ([2, 2, 1, 1] and [2, 2, 2, 2]): microbatch k would "
        "pair rows that do not belong together; give them the same batch size (or both "
        "multiples of the 4 microbatches)",
        "ok",
        "ValueError: rank 0: keyword 'scale' is a 0-dim tensor: it has no batch dimension to "
        "split into 4 microbatches (give it one, or pass a Python number, which every "
        "microbatch gets as it is)",
        "TypeError: rank 0: inputs must be a tensor or a pytree of tensors on this rank (the "
        "rank of stage 0), got None, and the keywords ['flag'] hold no tensor to split into "
        "microbatches either",
        "ok",
    ], zero
    for k in (0, 2, 3):
        assert one[k].startswith(f"RankError: rank 0: step failed: {zero[k]}"), one
    assert one[1] == one[4] == "ok"


def test_step_and_eval_take_torchs_keywords() -> None:
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from xgrad.torch_backend.pipeline import PipelineRuntime

    for method in ("step", "eval"):
        ours = inspect.signature(getattr(PipelineRuntime, method)).parameters
        theirs = inspect.signature(getattr(PipelineScheduleSingle, method)).parameters
        assert ours["kwargs"].kind is theirs["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    eval_ = inspect.signature(PipelineRuntime.eval).parameters["return_outputs"]
    step = inspect.signature(PipelineScheduleSingle.step).parameters["return_outputs"]
    assert eval_.kind is inspect.Parameter.KEYWORD_ONLY and eval_.default is step.default is True


SPLIT = ("1f1b", "zb_h1", "interleaved_zb", "zbv")


class _Gained(nn.Module):
    """A tanh layer whose output a keyword scales (every stage takes it, as each rank's
    keywords go to every stage it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, h: torch.Tensor, gain: Any = None) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * gain


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [_Gained() for _ in range(n)]


def _gains() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.rand(8, 1, generator=g, dtype=torch.float64) + 0.5 for _ in range(2)]


def _split_backward(rank: int, world: int) -> dict[tuple[str, str], Any]:
    import tanh_stages as ts

    from xgrad.torch_backend.pipeline import PipelineRuntime

    out: dict[tuple[str, str], Any] = {}
    for name in SPLIT:
        for checkpoint in ("never", "always"):
            made = ts.schedule(name)
            every = _stages(made.num_stages)
            mine = made.stages_of(rank)
            rt = PipelineRuntime(
                made, [every[s] for s in mine], nn.MSELoss(), checkpoint=checkpoint, timeout=20
            )
            x, y = ts.data()
            leaf = _gains()[rank].requires_grad_()
            # A keyword with a graph upstream, shared by the microbatches' chunks.
            rt.step(x, target=y, gain=leaf * 2)  # (each used where its stage is)
            grads = [p.grad for s in mine for p in every[s].parameters()]
            out[(name, checkpoint)] = (grads, leaf.grad)
    return out


def _whole(name: str) -> tuple[list[list[Any]], list[Any]]:
    """Per rank, its stages' parameter gradients and its keyword's, run as one model."""
    import tanh_stages as ts

    made = ts.schedule(name)
    every = _stages(made.num_stages)
    leaves = [g.requires_grad_() for g in _gains()]
    h, y = ts.data()
    for s, stage in enumerate(every):
        h = stage(h, gain=leaves[made.placement[s]] * 2)
    nn.functional.mse_loss(h, y).backward()
    grads = [[p.grad for s in made.stages_of(r) for p in every[s].parameters()] for r in (0, 1)]
    return grads, [leaf.grad for leaf in leaves]


def test_keyword_gradients_equal_the_whole_models_under_split_backward() -> None:
    """A keyword that requires grad, with a graph upstream, on every stage: under the
    split-backward schedules its gradient comes at W, which must then run the whole
    backward (the parameters' joins alone would leave it out); with checkpointing, the
    recomputed forward takes the keywords too."""
    results = spawn(_split_backward, 2, timeout=180)
    for name in SPLIT:
        grads, leaves = _whole(name)
        for checkpoint in ("never", "always"):
            for rank in (0, 1):
                got, leaf = results[rank][(name, checkpoint)]
                where = f"{name}, checkpoint={checkpoint}, rank {rank}"
                assert leaf is not None, where
                torch.testing.assert_close(leaf, leaves[rank], rtol=1e-12, atol=1e-15, msg=where)
                for g, w in zip(got, grads[rank], strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15, msg=where)


class _Clamping(_First):
    """A first stage that changes its mask keyword in place."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, **kw: Any) -> torch.Tensor:
        return super().forward(x, mask.clamp_(min=0), **kw)


def _in_place(rank: int, world: int) -> str:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = _Clamping() if rank == 0 else _part(1)
    rt = PipelineRuntime(xp.make("1f1b", 2, M), [part], nn.MSELoss(), checkpoint="always")
    d = _data()
    try:
        rt.step(d["x"], target=d["y"], **({"mask": d["mask"]} if rank == 0 else {}))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_a_checkpointed_stage_changing_a_keyword_in_place_is_refused() -> None:
    """Its recomputation would read the changed keyword, and give the gradients of another
    forward without a word, as for a changed input."""
    zero, one = spawn(_in_place, 2, timeout=90)
    want = (
        "0F0: stage 0's forward changed its input in place (tensor leaf 0 of keyword 'mask', "
        "shape (2, 5), torch.float64): with checkpoint='always' this forward runs again"
    )
    for text in (zero, one):  # raised on every rank, naming where
        assert text.startswith(f"RankError: rank 0: 0F0 failed: RuntimeError: {want}"), text
