"""Bucket caps read as PyTorch 2.13's DDP reads them, side by side with PyTorch's own code.

In process: every odd cap (text, ``None``, ``nan``, ``inf``, a bool, negative and tiny
values, in ``bucket_cap_mb`` and in ``bucket_cap_mb_list``) goes through PyTorch's cap
conversion and bucket assignment, and through :func:`resolve_caps`; both must accept it
(with the same ``bucket_bytes_cap``) or fail with the same exception type. One run of
two gloo ranks: ``bucket_cap_mb=-1`` trains to PyTorch's gradients with PyTorch's bucket
layout (one bucket: no cap, not even the first bucket's 1 MiB).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.nn.parallel.distributed import _BucketCapacityConfig
except ImportError:  # PyTorch before 2.13: no such class to compare with
    pytest.skip("needs PyTorch 2.13's _BucketCapacityConfig", allow_module_level=True)

from xgrad.buckets import NO_LIMIT
from xgrad.torch_backend.ddp_caps import resolve_caps
from xgrad.torch_backend.spawn import spawn

#: PyTorch's bucket assignment needs tensors; only their sizes matter.
_PARAMS = [torch.zeros(100), torch.zeros(2000), torch.zeros(30)]


def _pytorch(cap: object, cap_list: Any, find_unused: bool, static: bool) -> tuple[str, int | None]:
    """What PyTorch's DDP construction does with these caps: accepts (``bucket_bytes_cap``)
    or raises (its type), up to and including its first bucket assignment."""
    try:
        config = _BucketCapacityConfig.create(cap, cap_list, use_python_reducer=False)
        limits, _ = config.compute_bucket_size_limits(static, find_unused)
        dist._compute_bucket_assignment_by_size(_PARAMS, limits, [False] * len(_PARAMS))
    except Exception as err:
        return type(err).__name__, None
    return "accepted", config.bucket_bytes_cap


def _xgrad(cap: object, cap_list: Any, find_unused: bool, static: bool) -> tuple[str, int | None]:
    try:
        caps = resolve_caps(
            cap, None, cap_list, find_unused_parameters=find_unused, static_graph=static
        )
    except Exception as err:
        return type(err).__name__, None
    limits = caps.limits(find_unused_parameters=find_unused, static_graph=static)
    return "accepted", caps.attribute(limits.bucket_bytes_cap)


CASES = [
    # (bucket_cap_mb, bucket_cap_mb_list, find_unused_parameters, static_graph)
    (-1, None, False, False),
    (-1, None, False, True),
    (-1, None, True, True),
    (-1, None, True, False),
    (-0.5, None, True, False),
    (-1e-9, None, True, False),  # truncates to 0 bytes: a cap, not a negative one
    (1e-9, None, True, False),
    (True, None, False, False),
    ("a", None, False, False),
    ("1", None, False, False),
    (None, [None], False, False),
    ([1], None, False, False),
    (float("nan"), None, False, False),
    (float("inf"), None, False, False),
    (None, ["a"], False, False),
    (None, [""], False, False),
    (None, [None], False, False),
    (None, [[1]], False, False),
    (None, [0.001, "a"], False, False),
    (None, [float("inf")], False, False),
    (None, [float("nan")], False, False),
    (None, [0.001, -0.5], False, False),
    (None, [-1], False, True),
    ("a", [0.001], False, False),  # the list wins: bucket_cap_mb is never read
    (-1, [0.001], True, False),
    (None, [], False, False),  # an empty list is no list
    (3, None, False, False),
]


@pytest.mark.parametrize(("cap", "cap_list", "find_unused", "static"), CASES)
def test_caps_are_accepted_or_refused_as_pytorch_does(
    cap: object, cap_list: Any, find_unused: bool, static: bool
) -> None:
    assert _xgrad(cap, cap_list, find_unused, static) == _pytorch(
        cap, cap_list, find_unused, static
    )


def test_refusals_name_the_argument_and_the_value() -> None:
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\] = 'a': expected"):
        resolve_caps(None, None, [1, "a"], find_unused_parameters=False, static_graph=False)
    with pytest.raises(OverflowError, match=r"bucket_cap_mb = inf: expected a finite"):
        resolve_caps(float("inf"), None, None, find_unused_parameters=False, static_graph=False)
    with pytest.raises(TypeError, match=r"bucket_cap_mb = -1 is -1048576 bytes: with find_unu"):
        resolve_caps(-1, None, None, find_unused_parameters=True, static_graph=False)
    with pytest.raises(TypeError, match=r"bucket_cap_mb_list\[0\] = -1 is -1048576 bytes"):
        resolve_caps(None, None, [-1], find_unused_parameters=False, static_graph=True)


def test_a_negative_cap_is_no_cap_for_the_planner() -> None:
    caps = resolve_caps(-1, None, None, find_unused_parameters=False, static_graph=False)
    assert (caps.cap, caps.first, caps.attribute(NO_LIMIT)) == (NO_LIMIT, None, -(1 << 20))


def _negative_cap(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    keys = ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices")
    out: dict[str, Any] = {}
    for name, kw in {"plain": {}, "static": {"static_graph": True}}.items():
        torch.manual_seed(0)
        # 1.2 MB of parameters: a 1 MiB first bucket would split them.
        base = nn.Sequential(nn.Linear(4, 300), nn.Tanh(), nn.Linear(300, 1000))
        runs = []
        for cls in (DistributedDataParallel, TorchDDP):
            model = copy.deepcopy(base)
            ddp = cls(model, bucket_cap_mb=-1, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(rank)
            grads = []
            for _ in range(3):
                opt.zero_grad()
                ddp(torch.randn(2, 4, generator=g)).square().sum().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
            log = ddp._get_ddp_logging_data()
            attributes = (ddp.bucket_bytes_cap, ddp.bucket_bytes_cap_default)
            runs.append((grads, {k: log.get(k) for k in keys}, attributes))
        (ours, our_log, our_attr), (theirs, their_log, their_attr) = runs
        out[name] = {
            "equal": all(
                torch.equal(a, b)
                for step, ref in zip(ours, theirs, strict=True)
                for a, b in zip(step, ref, strict=True)
            ),
            "logs": (our_log, their_log),
            "attributes": (our_attr, their_attr),
        }
    return out


@pytest.fixture(scope="module")
def negative() -> list[dict[str, Any]]:
    return spawn(_negative_cap, 2, timeout=120)


@pytest.mark.parametrize("name", ["plain", "static"])
def test_a_negative_cap_trains_as_pytorchs_with_its_layout(
    negative: list[dict[str, Any]], name: str
) -> None:
    for result in negative:
        run = result[name]
        assert run["equal"]
        ours, theirs = run["logs"]
        assert ours == theirs
        if name == "plain":  # one bucket of all 1,210,000 bytes: no cap at all
            assert theirs["rebuilt_bucket_sizes"] == "1210000"
        assert run["attributes"] == ((-(1 << 20), False), (-(1 << 20), False))
