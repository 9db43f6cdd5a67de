"""A static graph's hooks: a parameter used in several reentrant backward passes.

With reentrant activation checkpointing a parameter used by several checkpointed
blocks gets its gradient accumulated, and its hook called, once per nested backward
pass. DDP's answer is ``static_graph``: its first iteration only counts the hooks of
each parameter (it reduces everything at its end, from the accumulated ``.grad``), and
from then on a parameter is ready at its last hook of the iteration, once its gradient
holds every contribution. :class:`HookCounts` is that count; the reducer asks it, at
each hook, whether to mark the parameter ready now.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class HookCounts:
    """Hooks per parameter per iteration, learned in a static graph's first iteration.

    Args:
        num_params: how many parameters the reducer reduces.
    """

    def __init__(self, num_params: int) -> None:
        self.num_params = num_params
        #: hooks per parameter in every iteration (``None`` until the first one ends).
        self.learned: list[int] | None = None
        #: some parameter's hook runs more than once per iteration.
        self.repeats = False
        self._left: list[int] = []
        # First iteration: index -> (latest gradient, time of the first hook), in the
        # order of the first hooks.
        self._held: dict[int, tuple[Any, float]] = {}
        self._seen = [0] * num_params

    def start(self) -> None:
        """A new iteration: forget what a failed one left; count down afresh."""
        if self.learned is None:
            self._held = {}
            self._seen = [0] * self.num_params
        elif self.repeats:
            self._left = list(self.learned)

    def active(self, learning: bool) -> bool:
        """Whether :meth:`hold` may keep a hook from marking (else every hook marks)."""
        return learning or self.repeats

    def hold(self, index: int, grad: Any, now: float, learning: bool) -> bool:
        """A hook of parameter ``index`` ran: True when it must not be marked ready now.

        ``learning``: the static graph's first iteration, where every gradient is held
        (the latest one, which has accumulated the earlier hooks' contributions) until
        :meth:`release`. Later, a parameter is marked at its last counted hook; a hook
        beyond the count is let through, so the reducer reports it as marked twice.
        """
        if learning:
            first = self._held.get(index)
            self._held[index] = (grad, now if first is None else first[1])
            self._seen[index] += 1
            return True
        if not self.repeats or self.learned is None or self.learned[index] <= 1:
            return False
        self._left[index] -= 1
        return self._left[index] > 0

    def release(self) -> Iterator[tuple[int, Any, float]]:
        """End of the first iteration: keep the counts; the held gradients, first hook first."""
        self.learned = self._seen
        self.repeats = any(n > 1 for n in self._seen)
        held, self._held = self._held, {}
        for index, (grad, when) in held.items():
            yield index, grad, when
