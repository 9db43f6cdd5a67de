"""The torch side of ``xgrad crosscheck``: a zoo model under xgrad's or PyTorch's DDP."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from xgrad.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketPlan,
    ddp_initial_plan,
    rebuild_plan,
)
from xgrad.hooks import HOOK_NAMES
from xgrad.torch_backend.spawn import spawn

__all__ = ["HOOK_NAMES", "IMPLEMENTATIONS", "run_ddp"]

IMPLEMENTATIONS = ("xgrad", "torch")


def run_ddp(
    model_name: str,
    weights: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    world_size: int,
    implementation: str = "xgrad",
    plan: BucketPlan | None = None,
    bucket_cap_mb: float | None = None,
    hook: str | None = None,
    steps: int = 1,
    timeout: float = 300.0,
    powersgd: dict[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Averaged gradients of zoo model ``model_name`` under DDP on ``world_size`` gloo ranks.

    Rank ``r`` gets the ``r``-th contiguous shard of ``x`` and ``y``. One untimed warm-up
    step runs first, then ``steps`` more; no optimizer step is taken, so every step
    differentiates at ``weights`` and the gradients returned are those of the last step
    (after the buckets were rebuilt, where DDP rebuilds them). The first of them rebuilds
    the buckets (a one-off: PyTorch's second iteration; xgrad's also checks that the ranks
    agree on the plan), so where more than one runs it is left out of the time per step,
    which is then the steady state's for both DDPs. (At the zoo's sizes a step takes a
    millisecond or so on CPUs, mostly scheduling: the two DDPs' order flips from run to
    run, with or without that step; ``xgrad bench ddp`` compares their speeds.)

    Args:
        model_name: a model of ``xgrad.models`` (built by ``xgrad.torch_backend.models``).
        weights: ``{name: array}`` in the model's parameter order; their dtype is the
            model's.
        x, y: the full batch (its length a multiple of ``world_size``).
        world_size: number of processes.
        implementation: ``"xgrad"`` (xgrad's DDP) or ``"torch"`` (PyTorch's).
        plan: a bucket plan for xgrad's DDP, used as given (PyTorch's takes none).
        bucket_cap_mb: DDP's ``bucket_cap_mb``.
        hook: ``None`` or one of :data:`HOOK_NAMES`. ``allreduce``/``fp16``/``bf16`` are
            xgrad's backend-neutral hooks under xgrad's DDP (the same arithmetic as
            PyTorch's, which PyTorch's DDP runs); ``powersgd`` is PyTorch's
            ``powerSGD_hook`` (rank 1, compressing from the second step, no error
            feedback) under either.
        steps: timed steps (at least 1).
        timeout: seconds for the whole run; nothing waits longer.
        powersgd: ``PowerSGDState`` keyword arguments for ``hook="powersgd"`` (default:
            rank 1 from the second step, no error feedback, no warm start).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank ``r`` on GPU ``r``).

    Returns:
        ``{"grads": {name: array}, "seconds_per_step": float, "plan": BucketPlan}`` from
        rank 0 (every rank holds the same gradients), ``plan`` being the one in use at the
        last step.

    Raises:
        ValueError: an unknown implementation or hook, a plan for PyTorch's DDP, a
            batch that does not split evenly, or ``steps < 1``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    if hook is not None and hook not in HOOK_NAMES:
        raise ValueError(f"hook={hook!r}: expected None or one of {HOOK_NAMES}")
    if plan is not None and implementation != "xgrad":
        raise ValueError("plan= is for implementation='xgrad'; PyTorch's DDP makes its own")
    if steps < 1:
        raise ValueError(f"steps={steps!r}: expected at least 1")
    if world_size < 1 or len(x) % world_size or len(y) != len(x):
        raise ValueError(
            f"a batch of {len(x)} inputs and {len(y)} targets does not split evenly over "
            f"world_size={world_size}"
        )
    settings = {
        "model": model_name,
        "weights": weights,
        "x": np.asarray(x),
        "y": np.asarray(y),
        "implementation": implementation,
        "plan": None if plan is None else plan.to_json(),
        "bucket_cap_mb": bucket_cap_mb,
        "hook": hook,
        "steps": steps,
        "timeout": timeout,
        "device": device,
        "powersgd": powersgd
        or {
            "matrix_approximation_rank": 1,
            "start_powerSGD_iter": 1,
            "use_error_feedback": False,
            "warm_start": False,
        },
    }
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    backend = "nccl" if device == "cuda" else "gloo"
    answer = spawn(_rank_main, world_size, args=(settings,), timeout=timeout, backend=backend)[0]
    answer["plan"] = BucketPlan.from_json(answer["plan"])
    return answer  # type: ignore[no-any-return]


def _rank_main(rank: int, world_size: int, s: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import xgrad.hooks
    from xgrad.models import shard
    from xgrad.torch_backend import models
    from xgrad.torch_backend.ddp import DistributedDataParallel

    device = f"cuda:{rank}" if s["device"] == "cuda" else "cpu"
    module = models.build(s["model"], s["weights"]).to(device)
    x = models.to_tensor(shard(s["x"], world_size, rank)).to(device)
    y = models.to_tensor(shard(s["y"], world_size, rank)).to(device)
    hook = s["hook"]
    if s["implementation"] == "xgrad":
        plan = None if s["plan"] is None else BucketPlan.from_json(s["plan"])
        ddp: Any = DistributedDataParallel(
            module,
            bucket_cap_mb=s["bucket_cap_mb"],
            plan=plan,
            comm_hook=xgrad.hooks.HOOKS.get(hook),
            timeout=s["timeout"],
        )
    else:
        ddp = TorchDDP(module, bucket_cap_mb=s["bucket_cap_mb"])
        torch_hooks = {
            "allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }
        if hook in torch_hooks:
            ddp.register_comm_hook(None, torch_hooks[hook])
    if hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, **s["powersgd"])
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    # The order gradients became ready in the warm-up step: what DDP rebuilds from.
    ready: list[int] = []
    params = [p for p in module.parameters() if p.requires_grad]
    handles = [
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready.append(i))
        for i, p in enumerate(params)
    ]
    seconds: list[float] = []
    untimed = 2 if s["steps"] > 1 else 1  # the warm-up, and the rebuild where others follow
    for step in range(s["steps"] + 1):
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        models.loss(ddp(x), y).backward()
        if step >= untimed:
            seconds.append(time.perf_counter() - start)
        if step == 0:
            for h in handles:
                h.remove()
    grads = {
        name: models.to_numpy(p.grad) if p.grad is not None else np.zeros_like(s["weights"][name])
        for name, p in module.named_parameters()
    }
    return {
        "grads": grads,
        "seconds_per_step": sum(seconds) / len(seconds),
        "plan": _plan_in_use(ddp, params, ready, s["bucket_cap_mb"]).to_json(),
    }


def _plan_in_use(
    ddp: Any, params: list[Any], ready: list[int], bucket_cap_mb: float | None
) -> BucketPlan:
    """The plan a DDP ran its last step with.

    PyTorch's DDP publishes its rebuilt buckets in its logging data only some iterations
    later; until then they are PyTorch's rebuild of the first ready order, which
    ``rebuild_plan`` reproduces (the DDP tests check the two agree).
    """
    if hasattr(ddp, "plan"):
        return ddp.plan  # type: ignore[no-any-return]
    import torch.distributed as dist

    nbytes = [p.numel() * p.element_size() for p in params]
    keys = [(p.dtype, p.device) for p in params]
    cap = DEFAULT_BUCKET_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
    # PyTorch's DDP reads its first bucket's cap from torch.distributed when it is built.
    first = int(dist._DEFAULT_FIRST_BUCKET_BYTES) if bucket_cap_mb is None else cap
    if sorted(ready) != list(range(len(params))):
        # No rebuild without a complete ready order: the initial plan is in use.
        return ddp_initial_plan(
            nbytes, keys=keys, bucket_cap_bytes=None if bucket_cap_mb is None else cap
        )
    return rebuild_plan(
        nbytes, ready, keys=keys, bucket_cap_bytes=cap, first_bucket_cap_bytes=first
    )
