"""torch's chunk specs on the pipeline runtime: ``args_chunk_spec``, ``kwargs_chunk_spec``
and ``output_merge_spec``, as torch 2.13's schedules take them.

torch's ``ScheduleGPipe(stage, m, loss_fn, args_chunk_spec=, kwargs_chunk_spec=,
output_merge_spec=)`` splits a step's inputs and keywords as the specs say
(``TensorChunkSpec(1)`` for sequence-first data, ``_Replicate`` for a value given whole to
every microbatch) and merges the last stage's outputs along the spec'd dim
(``torch.distributed.pipelining.microbatch``). xgrad's runtime took no specs (a
``TypeError``): every tensor split along dim 0. On two gloo ranks, each running torch's
ScheduleGPipe / Schedule1F1B and then xgrad's runtime on the same stages, weights, batch,
keywords and specs: sequence-first inputs, a mask and a keyword container split along dim 1,
a bias, a 0-dim temperature, a scale that requires grad and a flag given whole, outputs
merged along dim 1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _Replicate,
    merge_chunks,
    split_args_kwargs_into_chunks,
    sum_reducer,
)

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M = 4
S, B = 3, 8  # sequence-first: (S, B, features); torch splits the targets along dim 0 alone
T0, T1 = TensorChunkSpec(0), TensorChunkSpec(1)


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5).double()

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        bias: torch.Tensor,
        temp: torch.Tensor,
        pair: tuple[torch.Tensor, torch.Tensor],
        scale: torch.Tensor,
        flag: bool,
    ) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + bias) * mask / temp
        h = (h + pair[0] + pair[1]) * scale
        return -h if flag else h


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2).double()

    def forward(self, h: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + shift


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.transpose(0, 1), target)  # targets batch-first


def _part(rank: int) -> nn.Module:
    torch.manual_seed(0)
    parts = [_First(), _Last()]
    return parts[rank]


def _draw(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _keywords(rank: int, flag: bool) -> dict[str, Any]:
    """Each rank's keywords for the model (a fresh ``scale`` leaf each call)."""
    if rank == 1:
        return {"shift": _draw(2, S, B, 2)}
    return {
        "mask": _draw(3, S, B, 5),  # sequence-first, along dim 1
        "bias": _draw(4, 5),  # whole
        "temp": torch.tensor(1.5, dtype=torch.float64),  # 0-dim, whole
        "pair": (_draw(5, 1, B, 5), _draw(6, S, B, 5)),  # a container, along dim 1
        "scale": _draw(7, 1, 1, 5).requires_grad_(),  # whole, its gradient compared
        "flag": flag,
    }


#: rank 0's keyword specs, in the keywords' order (torch pairs them by position).
KWARGS_SPEC: dict[str, Any] = {
    "mask": T1,
    "bias": _Replicate(),
    "temp": _Replicate,  # torch takes the class too
    "pair": (T1, T1),
    "scale": _Replicate(),
    "flag": _Replicate(),
}


def _grads(module: nn.Module, kw: dict[str, Any]) -> list[Any]:
    found = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [*found, kw["scale"].grad if "scale" in kw else None]


def _both(rank: int, world: int, name: str, merge: Any) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from xgrad.torch_backend.pipeline import PipelineRuntime

    x = _draw(1, S, B, 3) if rank == 0 else None
    y = _draw(8, B, S, 2) if rank == 1 else None
    kwargs_spec = KWARGS_SPEC if rank == 0 else {"shift": T1}
    specs = {"args_chunk_spec": (T1,), "output_merge_spec": merge}
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    theirs_part, ours_part = _part(rank), _part(rank)
    stage = PipelineStage(theirs_part, rank, 2, torch.device("cpu"))
    theirs = cls(stage, M, loss_fn=_loss, kwargs_chunk_spec=kwargs_spec, **specs)
    # xgrad's pairs the keywords' specs by name: given here in the other order.
    mine = dict(reversed(list(kwargs_spec.items())))
    rt = PipelineRuntime(
        xp.make(name, 2, M), [ours_part], _loss, timeout=20, kwargs_chunk_spec=mine, **specs
    )
    out: dict[str, Any] = {"torch": [], "ours": []}
    for side, part in (("torch", theirs_part), ("ours", ours_part)):
        for flag in (True, False):
            kw = _keywords(rank, flag)
            losses: list[Any] = []
            args = () if x is None else (x,)
            if side == "torch":
                got = theirs.step(*args, target=y, losses=losses, **kw)
            else:
                got = rt.step(x, target=y, losses=losses, return_outputs=True, **kw)
            out[side].append({"out": got, "losses": losses, "grads": _grads(part, kw)})
        kw = _keywords(rank, True)
        got = theirs.eval(*args, target=y, **kw) if side == "torch" else rt.eval(x, y, **kw)
        out[side].append({"out": None if got is None else _detached(got)})
    return out


def _detached(tree: Any) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


def _equal(got: Any, want: Any) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.shape, want.shape)
        assert torch.equal(got, want)  # bit for bit
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _equal(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _equal(got[key], want[key])
    else:
        assert got == want


def _whole_scale_grad(flag: bool) -> torch.Tensor:
    """The gradient of the whole ``scale`` in the unpipelined model, on the whole batch."""
    kw = _keywords(0, flag)
    h = _part(0)(_draw(1, S, B, 3), **kw)
    _loss(_part(1)(h, **_keywords(1, flag)), _draw(8, B, S, 2)).backward()
    return kw["scale"].grad


@pytest.mark.parametrize(
    ("name", "merge"),
    [("gpipe", T1), ("1f1b", (T1,))],  # (T1,): torch returns the one output as a 1-tuple
)
def test_specs_split_and_merge_as_torchs_do(name: str, merge: Any) -> None:
    first, last = spawn(_both, 2, args=(name, merge), timeout=120)
    for rank in (first, last):
        theirs, ours = rank["torch"], rank["ours"]
        for k in (0, 1):  # flag=True, then flag=False
            _equal(ours[k]["losses"], theirs[k]["losses"])
            _equal(ours[k]["out"], theirs[k]["out"])
            _equal(ours[k]["grads"][:-1], theirs[k]["grads"][:-1])
            # A whole keyword that requires grad: torch's stage_backward sets each input's
            # .grad to None after each microbatch's backward, the user's leaf too when it
            # is given whole: its gradient is lost without a word. xgrad's is the
            # unpipelined model's.
            assert theirs[k]["grads"][-1] is None
        _equal(ours[2]["out"], theirs[2]["out"])  # eval merges as the step
    for k, flag in ((0, True), (1, False)):
        want = _whole_scale_grad(flag)
        torch.testing.assert_close(first["ours"][k]["grads"][-1], want, rtol=1e-12, atol=1e-14)
    merged = last["ours"][0]["out"]
    if isinstance(merge, tuple):
        assert isinstance(merged, tuple) and len(merged) == 1
        merged = merged[0]
    assert merged.shape == (S, B, 2)  # along dim 1, sequence-first
    assert len(last["ours"][0]["losses"]) == M
    # the flag made a difference (the keywords reached the stage)
    assert not torch.equal(last["ours"][0]["losses"][0], last["ours"][1]["losses"][0])


# -- the specs' splitting and merging against torch's own functions ------------------


def _split(keywords: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    from xgrad.torch_backend.pipeline_specs import chunk_specs, split_keywords_by_spec

    checked = chunk_specs(None, spec, None, 0).kwargs
    assert checked is not None
    return split_keywords_by_spec(keywords, checked, M, 0)


def _torchs(keywords: dict[str, Any], spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    return split_args_kwargs_into_chunks((), keywords, M, None, spec)[1]


def test_keyword_specs_split_as_torchs() -> None:
    a, b = _draw(1, 3, 8, 2), _draw(2, 8, 4)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"mask": a}, {"mask": T1}),
        ({"mask": a}, {"mask": TensorChunkSpec(-2)}),
        ({"pair": (a, b), "n": 3}, {"pair": (T1, T0), "n": _Replicate()}),
        ({"d": {"e": a, "f": b}}, {"d": {"e": T1, "f": _Replicate}}),
        ({"t": torch.tensor(2.0)}, {"t": _Replicate()}),
    ]
    for keywords, spec in cases:
        _equal(_split(keywords, spec), _torchs(keywords, spec))
    # xgrad's default splits a container's tensors along dim 0, as torch's does
    _equal(_split({"pair": (b, b)}, {"pair": T0}), _torchs({"pair": (b, b)}, None))


def test_a_leaf_spec_stands_for_its_subtree() -> None:
    """torch needs a spec per leaf; here one spec may stand for a container's leaves:
    ``_Replicate()`` gives it whole (torch's ``(_Replicate(), _Replicate())``), and
    ``TensorChunkSpec(1)`` splits each of its tensors along dim 1."""
    a = _draw(1, 3, 8, 2)
    pair = {"pair": (a, a, "tag")}
    whole = (_Replicate(), _Replicate(), _Replicate())
    _equal(_split(pair, {"pair": _Replicate()}), _torchs(pair, {"pair": whole}))
    along = (T1, T1, _Replicate())
    _equal(_split(pair, {"pair": T1}), _torchs(pair, {"pair": along}))
    # torch's rule, leaf by leaf in order, where the structures differ: a list for a tuple
    _equal(_split(pair, {"pair": [T1, T1, _Replicate()]}), _torchs(pair, {"pair": along}))


def test_keyword_specs_go_by_name_where_torchs_go_by_position() -> None:
    """torch pairs ``kwargs_chunk_spec`` with the keywords by position: given in another
    order, the mask is split along the position's dim, and a misspelt name passes."""
    mask, pos = _draw(1, 4, 8), _draw(2, 8, 4)
    keywords = {"mask": mask, "pos": pos}
    spec = {"pos": T0, "mask": T1}
    theirs = _torchs(keywords, spec)[0]
    assert theirs["mask"].shape == (1, 8) and theirs["pos"].shape == (8, 1)  # swapped
    ours = _split(keywords, spec)[0]
    assert ours["mask"].shape == (4, 2) and ours["pos"].shape == (2, 4)
    assert _torchs(keywords, {"msk": T1, "pos": T0})[0]["mask"].shape == (4, 2)  # unseen
    with pytest.raises(ValueError, match=r"no spec for keyword\(s\) \['mask'\]"):
        _split(keywords, {"msk": T1, "pos": T0})


def test_args_specs_split_as_torchs() -> None:
    from xgrad.torch_backend.pipeline_specs import split_inputs

    x, y = _draw(1, 3, 8, 2), _draw(2, 8, 4)
    got = split_inputs(x, (T1,), M, 0)
    _equal([(c,) for c in got], split_args_kwargs_into_chunks((x,), None, M, (T1,))[0])
    got = split_inputs((x, y), ((T1, T0),), M, 0)
    want = split_args_kwargs_into_chunks(((x, y),), None, M, ((T1, T0),))[0]
    _equal([(c,) for c in got], want)
    # torch's form for two positional arguments, xgrad's inputs a tuple of them
    got = split_inputs((x, y), (T1, T0), M, 0)
    _equal(got, split_args_kwargs_into_chunks((x, y), None, M, (T1, T0))[0])


def test_output_specs_merge_as_torchs() -> None:
    from xgrad.torch_backend.pipeline_call import merge_outputs

    y = [_draw(k, 3, 2, 5) for k in range(M)]
    losses = [_draw(10 + k, 1).sum() for k in range(M)]
    cases: list[tuple[list[Any], Any]] = [
        (y, T1),
        (y, (T1,)),  # torch's: the spec's structure, a 1-tuple
        (y, TensorChunkSpec(-1)),
        ([(t, loss) for t, loss in zip(y, losses, strict=True)], (T1, sum_reducer)),
        ([{"y": t, "n": 3} for t in y], {"y": T1, "n": None}),
        ([{"y": t, "n": 3} for t in y], {"y": T1, "n": _Replicate()}),
    ]
    for chunks, spec in cases:
        _equal(merge_outputs(chunks, spec, 1), merge_chunks(chunks, spec))
    _equal(merge_outputs(y), merge_chunks(y, None))  # no spec: along dim 0, as before


# -- bad specs -------------------------------------------------------------------------


def _bad(rank: int, world: int) -> dict[str, list[str]]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    def attempt(fn: Any) -> str:
        try:
            fn()
            return "ok"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    sched = xp.make("1f1b", 2, M)
    made = [
        attempt(lambda spec=spec: PipelineRuntime(sched, [_part(rank)], _loss, **spec))
        for spec in (
            {"args_chunk_spec": T1},
            {"kwargs_chunk_spec": {"mask": 1}},
            {"kwargs_chunk_spec": [T1]},
            {"args_chunk_spec": (TensorChunkSpec("1"),)},
        )
    ]
    spec = {"mask": T1, "bias": _Replicate(), "temp": _Replicate(), "pair": T1}
    spec.update(scale=_Replicate(), flag=_Replicate())
    rt = PipelineRuntime(
        sched,
        [_part(rank)],
        _loss,
        timeout=10,
        args_chunk_spec=(T1,),
        kwargs_chunk_spec=spec if rank == 0 else {"shift": T1},
        output_merge_spec=TensorChunkSpec(3) if rank == 1 else None,
    )
    good = _draw(1, S, B, 3)
    y = _draw(8, B, S, 2) if rank == 1 else None
    kw = _keywords(rank, True)
    steps: list[tuple[Any, dict[str, Any], bool]] = [
        (_draw(1, S, 6, 3), kw, False),  # 6 rows along dim 1 (before the private group)
        (good, kw, False),
        (_draw(1, 8), kw, False),  # no dim 1
        (good, {**kw, "extra": 1}, False),  # a keyword without a spec
        (good, {k: v for k, v in kw.items() if k != "bias"}, False),  # a spec without one
        (good, {**kw, "mask": torch.tensor(1.0)}, False),  # 0-dim along dim 1
        (good, kw, True),  # the outputs along dim 3, which they have not
        (good, kw, False),
    ]
    stepped = []
    for x, keywords, outputs in steps:
        mine = keywords if rank == 0 else _keywords(1, True)
        run = lambda: rt.step(x, target=y, return_outputs=outputs, **mine)  # noqa: B023, E731
        stepped.append(attempt(run))
    return {"made": made, "stepped": stepped}


def test_bad_specs_are_refused_naming_them_on_every_rank() -> None:
    """At construction for a spec of the wrong type; at the step, on the rank given the
    value, before it sends anything, for a spec that does not fit it (its peer's step
    fails naming that rank); the outputs after the step, on their rank alone. torch raises
    an ``IndexError``, an ``AssertionError`` or none (a size that does not divide splits
    unevenly, a misspelt keyword is paired by position)."""
    from ranks import run_ranks

    results, _ = run_ranks(_bad, 2, timeout=60)
    zero, one = results[0][1], results[1][1]
    for rank, got in ((0, zero), (1, one)):
        assert got["made"] == [
            f"TypeError: rank {rank}: args_chunk_spec must be a tuple, a spec per positional "
            "argument of stage 0 (xgrad's step gives it one, the inputs: (TensorChunkSpec(1),"
            ") for sequence-first inputs), got TensorChunkSpec(1)",
            f"TypeError: rank {rank}: kwargs_chunk_spec['mask'] holds 1 (int); its leaves "
            "must be TensorChunkSpec(split_dim) or _Replicate() "
            "(torch.distributed.pipelining.microbatch)",
            f"TypeError: rank {rank}: kwargs_chunk_spec must be a dict from keyword names to "
            "specs, got [TensorChunkSpec(1)]",
            f"TypeError: rank {rank}: args_chunk_spec holds a TensorChunkSpec whose split_dim "
            "'1' is a str, not an int",
        ], got["made"]
    stepped = zero["stepped"]
    assert stepped == [
        "ValueError: rank 0: inputs size 6 along dim 1 (args_chunk_spec[0] TensorChunkSpec(1)) "
        "and keyword 'mask' size 8 along dim 1 (kwargs_chunk_spec['mask'] TensorChunkSpec(1)) "
        "split into microbatches of different rows ([2, 2, 1, 1] and [2, 2, 2, 2]): "
        "microbatch k would pair rows that do not belong together; give them the same batch "
        "size (or both multiples of the 4 microbatches)",
        "ok",
        "ValueError: rank 0: args_chunk_spec[0] is TensorChunkSpec(1), and inputs has 1 dims "
        "(shape [8]): split_dim must be in [-1, 0]",
        "ValueError: rank 0: kwargs_chunk_spec has no spec for keyword(s) ['extra'] this step "
        "gives (it gives ['mask', 'bias', 'temp', 'pair', 'scale', 'flag', 'extra']); as "
        "torch's schedules, a spec names exactly the keywords of each step given any "
        "(TensorChunkSpec(dim), or _Replicate() for a value given whole to every microbatch)",
        "ValueError: rank 0: kwargs_chunk_spec names ['bias'], which this step does not give "
        "(it gives ['mask', 'temp', 'pair', 'scale', 'flag']); as torch's schedules, a spec "
        "names exactly the keywords of each step given any (TensorChunkSpec(dim), or "
        "_Replicate() for a value given whole to every microbatch)",
        "ValueError: rank 0: keyword 'mask' is a 0-dim tensor, and kwargs_chunk_spec['mask'] "
        "is TensorChunkSpec(1): it has no dim 1 to split into 4 microbatches (_Replicate() "
        "gives it whole to each)",
        "ok",
        "ok",
    ], stepped
    theirs = one["stepped"]
    for k in (0, 2, 3, 4, 5):
        assert theirs[k].startswith(f"RankError: rank 0: step failed: {stepped[k]}"), theirs
    assert theirs[1] == theirs[7] == "ok"
    assert theirs[6] == (
        "ValueError: rank 1: output_merge_spec gives the last stage's output "
        "TensorChunkSpec(3), and it has 3 dims (shape [3, 2, 2]): split_dim must be in "
        "[-3, 2]"
    ), theirs


def test_the_runtime_takes_torchs_spec_arguments() -> None:
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from xgrad.torch_backend.pipeline import PipelineRuntime

    ours = inspect.signature(PipelineRuntime.__init__).parameters
    theirs = inspect.signature(PipelineScheduleSingle.__init__).parameters
    for name in ("args_chunk_spec", "kwargs_chunk_spec", "output_merge_spec"):
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert ours[name].default is theirs[name].default is None
