"""What may change on a reducer after construction: its hook, static graph flag and plan.

PyTorch's DDP lets a communication hook be registered and a static graph be declared
after the wrapper is built (``register_comm_hook``, ``_set_static_graph``), as long as no
iteration has started, and rebuilds its buckets once, from the first ready order. Those
doors are here, kept apart from the per-gradient state
machine in :mod:`xgrad.reducer` (whose class mixes this in); nothing outside the reducer
sets its hook or flags. The plan's views and sizes, which the wrapper reads again after
a rebuild, are read here too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from xgrad.buckets import BucketPlan, assign_buckets

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.reducer_buckets import BucketState
    from xgrad.reducer_types import Hook


class LateSetup:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    comm: Comm
    num_iterations: int
    static_graph: bool
    _expect_hooks: bool
    _hook: Hook | None
    _serial_hooks: bool
    _divisor: int
    _scale: float | None
    rebuild: bool
    has_rebuilt_buckets: bool
    find_unused_parameters: bool
    nbytes: list[int]
    keys: list[Hashable]
    sparse: list[bool]
    rebuild_limits: Sequence[int]
    _rebuild_order: list[int] | None
    _require_finalize: bool

    plan: BucketPlan
    _locate: list[tuple[BucketState, int]]
    params: list[Any]
    ops: Any

    def _ensure_prior_reduction_finished(self) -> None: ...  # defined by the reducer

    def _set_plan(self, plan: BucketPlan) -> None: ...  # defined by the reducer

    @property
    def hook(self) -> Hook | None:
        """The communication hook (``None``: DDP's default pre-divided allreduce)."""
        return self._hook

    @property
    def serial_hooks(self) -> bool:
        """Whether bucket ``b``'s hook finishes before bucket ``b + 1``'s starts."""
        return self._serial_hooks

    def _set_hook(self, hook: Hook | None, serial: bool) -> None:
        self._hook = hook
        self._serial_hooks = serial
        # Without a hook the reducer pre-divides while copying; a hook divides itself.
        self._divisor = self.comm.size
        self._scale = 1.0 / self._divisor if hook is None else None

    def register_hook(self, hook: Hook, *, serial: bool = False) -> None:
        """Install a communication hook after construction (DDP's ``register_comm_hook``).

        Args:
            hook: the hook with its state bound.
            serial: see ``serial_hooks`` in the class docstring.

        Between iterations, as PyTorch's DDP allows: the hook reduces from the next
        synchronised pass on.

        Raises:
            RuntimeError: a hook is already installed, or a pass is under way (between a
                synchronised forward pass and the end of its backward pass).
        """
        if self._hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if self._expect_hooks or self._require_finalize:
            raise RuntimeError(
                "register_comm_hook cannot be called while a backward pass is expected or "
                f"under way (rank {self.comm.rank}): call it between iterations"
            )
        self._set_hook(hook, serial)

    def set_static_graph(self) -> None:
        """Switch to ``static_graph`` before the first iteration (DDP's ``_set_static_graph``)."""
        if self.num_iterations or self._expect_hooks:
            raise RuntimeError(  # PyTorch's words
                "set_static_graph() should be called before training loop starts and after "
                f"DistributedDataParallel is constructed (rank {self.comm.rank})."
            )
        self.static_graph = True

    def relayout(self) -> bool:
        """Read the parameters' kinds and sizes again after they changed dtype or device
        (the module converted after the reducer was made: ``ddp.double()``); if any did,
        make the buckets again for the same plan, re-planned in the same order where a
        bucket would now mix kinds. The buckets kept the old dtype otherwise, and every
        later gradient was reduced in it (float64 gradients through float32 buckets).

        Returns:
            True when the buckets were made again (gradient views must be re-taken).
        """
        keys = [self.ops.key(p) for p in self.params]
        if keys == self.keys:
            return False
        self._ensure_prior_reduction_finished()
        self.keys = keys
        self.nbytes = [self.ops.nbytes(p) for p in self.params]
        plan = self.plan
        if any(len({keys[i] for i in bucket}) > 1 for bucket in plan.buckets):
            order = [i for bucket in plan.buckets for i in bucket]
            limits = self.rebuild_limits
            plan = assign_buckets(self.nbytes, limits, keys=keys, sparse=self.sparse, order=order)
        self._set_plan(plan)
        return True

    def bucket_views(self) -> list[Any]:
        """Per parameter, its view into the bucket buffers (``None`` for a sparse one)."""
        return [bucket.in_views[k] for bucket, k in self._locate]

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [sum(self.nbytes[i] for i in b) for b in self.plan.buckets]

    def rebuild_due(self) -> bool:
        """Whether :meth:`rebuild_buckets` would rebuild now (a collective: the plan
        broadcast), so that a caller can finish what it has under way on the group first."""
        if not self.rebuild or self.has_rebuilt_buckets or self._rebuild_order is None:
            return False
        return not self.find_unused_parameters or self.static_graph

    def rebuild_buckets(self) -> bool:
        """Rebuild the buckets once from the first observed ready order (call in forward).

        As in DDP, this happens only when the plan can be trusted to repeat: without
        ``find_unused_parameters`` or with ``static_graph``. Every rank computes the plan
        from its own order and adopts rank 0's, so all ranks launch the same buckets.

        Returns:
            True when rebuilt (gradient views must then be re-taken).
        """
        self._ensure_prior_reduction_finished()
        if not self.rebuild_due():
            return False
        local = assign_buckets(
            self.nbytes,
            self.rebuild_limits,
            keys=self.keys,
            sparse=self.sparse,
            order=self._rebuild_order,
        )
        plan = BucketPlan.from_json(self.comm.broadcast_object(local.to_json(), src=0))
        self._set_plan(plan)
        self.has_rebuilt_buckets = True
        self._rebuild_order = None
        return True
