"""What the DDP refuses at construction, and what its ranks compare before reducing.

Bad arguments are refused where their names are still known (``timeout``, ``plan``, a
parameter on the meta device; the bucket caps in :mod:`.ddp_caps`), with the value in the
message, instead of failing later as something else. The agreement check (plan,
parameters, hook) is the core's :mod:`xgrad.agreement`; this module only describes a DDP
for it.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence

import torch

from xgrad.agreement import Fingerprint, data_parallel_fingerprint
from xgrad.buckets import BucketPlan
from xgrad.failure import as_seconds
from xgrad.torch_backend.comm import DEFAULT_TIMEOUT_S
from xgrad.torch_backend.sync import describe_params

__all__ = [
    "TIMEOUT_ENV",
    "check_params",
    "check_plan",
    "fingerprint",
    "resolve_timeout",
    "warn_as_pytorch",
]

#: environment variable that overrides the default ``timeout=`` (seconds).
TIMEOUT_ENV = "XGRAD_DDP_TIMEOUT"


def _check_seconds(value: object, name: str) -> float:
    number = as_seconds(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} = {value!r}: expected a finite number of seconds > 0")
    return float(number)


def resolve_timeout(timeout: object) -> float:
    """``timeout=`` in seconds (a ``timedelta`` too): the value given, else
    ``$XGRAD_DDP_TIMEOUT``, else 300.

    ``nan``, ``inf``, zero and negative values are refused here rather than accepted and
    failing (or never failing) at the first wait.
    """
    if timeout is not None:
        return _check_seconds(timeout, "timeout")
    env = os.environ.get(TIMEOUT_ENV)
    if env is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds") from None
    return _check_seconds(value, TIMEOUT_ENV)


def check_plan(plan: object, num_params: int) -> BucketPlan | None:
    """``plan=`` as given, if it is a :class:`BucketPlan` over ``num_params`` parameters."""
    if plan is None:
        return None
    if not isinstance(plan, BucketPlan):
        hint = " (JSON text: pass BucketPlan.from_json(text))" if isinstance(plan, str) else ""
        raise TypeError(f"plan must be a BucketPlan, got {type(plan).__name__} {plan!r:.80}{hint}")
    if plan.num_params != num_params:
        raise ValueError(
            f"plan covers {plan.num_params} parameters but the module has {num_params} "
            "that require grad"
        )
    return plan


def check_params(names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
    """Refuse parameters that cannot be reduced: on the meta device (no storage)."""
    meta = [name for name, p in zip(names, params, strict=True) if p.device.type == "meta"]
    if meta:
        shown = ", ".join(meta[:5]) + (f" (+{len(meta) - 5} more)" if len(meta) > 5 else "")
        raise ValueError(
            f"parameters on the meta device have no data to reduce: {shown}; materialise "
            "the module first (module.to_empty(device=...) and initialise it)"
        )


def fingerprint(
    plan: BucketPlan, names: Sequence[str], params: Sequence[torch.Tensor], hook: str
) -> Fingerprint:
    """This rank's plan, parameter list and hook, as the ranks compare them."""
    return data_parallel_fingerprint(plan, describe_params(names, params), hook)


def warn_as_pytorch(check_reduction: bool, static_graph: bool, find_unused: bool) -> None:
    """PyTorch DDP's warnings about its arguments, in its words: ``check_reduction`` is
    deprecated; a static graph finds unused parameters by itself."""
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` "
            "module is deprecated. Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )
    if static_graph and find_unused:
        warnings.warn(
            "You passed find_unused_parameters=true to DistributedDataParallel, "
            "`_set_static_graph` will detect unused parameters automatically, so "
            "you do not need to set find_unused_parameters=true, just be sure these "
            "unused parameters will not change during training loop while calling "
            "`_set_static_graph`.",
            stacklevel=3,
        )
