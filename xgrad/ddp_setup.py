"""DDP's front end, shared by every backend: caps, then the initial plan, then the reducer.

Every data-parallel wrapper (the torch ``DistributedDataParallel``, the reference
backend's ``DataParallel``) turns the user's bucket caps into DDP's bucket limits, picks
the plan DDP starts with, and builds a :class:`~xgrad.reducer.Reducer` that rebuilds its
buckets once unless a plan was given. That sequence lives here, once::

    caps (bucket_cap_mb, first cap, bucket_cap_mb_list)
      -> DDPLimits (initial limits, rebuild limits)
      -> initial plan (reversed: gradients arrive roughly in reverse)  or  the plan given
      -> Reducer(rebuild = no plan given)

so no wrapper reaches into the reducer after building it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from xgrad.backend import Comm
from xgrad.buckets import NO_LIMIT, BucketPlan, assign_buckets, ddp_bucket_caps
from xgrad.reducer import ArrayOps, Hook, Reducer
from xgrad.reducer_types import Lender


@dataclass(frozen=True)
class DDPLimits:
    """DDP's bucket limits in bytes: for the initial plan, and for the one rebuild.

    Attributes:
        initial: limits of the plan DDP starts with (the last one repeats).
        rebuild: limits of the plan rebuilt from the first ready order.
        bucket_bytes_cap: DDP's ``bucket_bytes_cap`` attribute (the largest cap).
    """

    initial: tuple[int, ...]
    rebuild: tuple[int, ...]
    bucket_bytes_cap: int

    @classmethod
    def of(
        cls,
        *,
        bucket_cap_bytes: int | None = None,
        first_bucket_cap_bytes: int | None = None,
        bucket_cap_bytes_list: Sequence[int] | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ) -> DDPLimits:
        """The limits PyTorch's DDP derives from its arguments.

        With ``bucket_cap_bytes_list`` (PyTorch's ``bucket_cap_mb_list``) bucket ``b`` of
        both plans gets cap ``b`` (the last repeating) and the other caps are ignored.
        Otherwise the caps follow :func:`~xgrad.buckets.ddp_bucket_caps`, and the
        initial plan is one bucket for all when it will be rebuilt anyway (no unused
        parameters searched, or a static graph).

        Raises:
            ValueError: an empty list or a cap that is not a positive byte count.
        """
        if bucket_cap_bytes_list is not None:
            caps = tuple(bucket_cap_bytes_list)
            if not caps or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in caps
            ):
                raise ValueError(
                    f"bucket_cap_mb_list={list(caps)!r}: expected a non-empty list of "
                    "bucket caps >= 0"
                )
            return cls(caps, caps, max(caps))
        first, cap = ddp_bucket_caps(bucket_cap_bytes, first_bucket_cap_bytes)
        if static_graph or not find_unused_parameters:
            initial: tuple[int, ...] = (NO_LIMIT,)
        elif first < cap:
            initial = (first, cap)
        else:
            initial = (cap,)
        return cls(initial, (first, cap), cap)

    def initial_plan(
        self,
        nbytes: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        sparse: Sequence[bool] | None = None,
    ) -> BucketPlan:
        """The plan DDP starts with: definition order, launched in reverse."""
        return assign_buckets(nbytes, self.initial, keys=keys, sparse=sparse).reversed()


def ddp_reducer(
    params: Sequence[Any],
    comm: Comm,
    ops: ArrayOps,
    *,
    set_grad: Callable[[int, Any], None],
    limits: DDPLimits,
    plan: BucketPlan | None = None,
    names: Sequence[str] | None = None,
    sparse: Sequence[bool] | None = None,
    nbytes: Sequence[int] | None = None,
    keys: Sequence[Hashable] | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = False,
    skip_all_reduce_unused_params: bool = False,
    batched_grad_copy: bool = False,
    hook: Hook | None = None,
    clock: Callable[[], float] = time.perf_counter,
    lender: Lender | None = None,
    set_grads: Callable[[Sequence[int], Sequence[Any]], None] | None = None,
    get_grad: Callable[[int], Any] | None = None,
) -> Reducer:
    """A reducer set up as DDP sets up its own: the initial plan, or ``plan`` used as given.

    Args:
        params: the reduced parameters, in DDP's order.
        limits: the bucket limits (:meth:`DDPLimits.of`).
        plan: an explicit plan over ``params``; then the buckets are never rebuilt.
        The rest: as :class:`~xgrad.reducer.Reducer` takes them.

    Raises:
        ValueError: ``plan`` does not cover exactly ``params``.
    """
    nbytes = list(nbytes) if nbytes is not None else [ops.nbytes(p) for p in params]
    keys = list(keys) if keys is not None else [ops.key(p) for p in params]
    if plan is not None and plan.num_params != len(params):
        raise ValueError(
            f"plan covers {plan.num_params} parameters but the module has "
            f"{len(params)} that require grad"
        )
    return Reducer(
        params,
        plan if plan is not None else limits.initial_plan(nbytes, keys, sparse),
        comm,
        ops,
        set_grad=set_grad,
        names=names,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
        hook=hook,
        rebuild=plan is None,
        rebuild_limits=limits.rebuild,
        sparse=sparse,
        skip_all_reduce_unused_params=skip_all_reduce_unused_params,
        batched_grad_copy=batched_grad_copy,
        nbytes=nbytes,
        keys=keys,
        clock=clock,
        lender=lender,
        set_grads=set_grads,
        get_grad=get_grad,
    )
