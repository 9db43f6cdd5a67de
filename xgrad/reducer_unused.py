"""Which parameters got no gradient: in this iteration on this rank, and on every rank.

DDP marks a locally unused parameter ready with a zero gradient (so the buckets still
line up across ranks) but leaves the gradient of a parameter that *no* rank used
untouched; finding those costs one extra allreduce of a per-rank used map. With a
static graph the unused set is learned once, in the first iteration, and reused.

A rank that has joined (run out of inputs) sends, as PyTorch's DDP does, the last
summed map it has (PyTorch's joined rank re-sends its reducer's map, which the
allreduce overwrote with the sum), updated by each sum it takes part in: a parameter
used anywhere in that rank's last iteration, or since, counts as used, so the ranks
still training give it a zero gradient rather than none (SGD's momentum then moves it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xgrad.backend import Comm, Work
from xgrad.reducer_types import ArrayOps


class UnusedParams:
    """The reducer's unused-parameter bookkeeping.

    Args:
        num_params: how many parameters the reducer reduces.
    """

    def __init__(self, num_params: int) -> None:
        self.num_params = num_params
        #: unused on this rank in the current iteration (found by the caller's graph walk).
        self.local: list[int] = []
        #: a static graph's unused set, learned in its first iteration.
        self.static: list[int] | None = None
        self._static_global: set[int] | None = None
        self._pending: Work | None = None
        #: the last summed used map (per parameter, how many ranks used it): what a
        #: joined rank sends instead of its own.
        self._last_sum: np.ndarray | None = None
        #: used in a pass outside synchronisation (``no_sync``) since the last used map.
        self.used_unsynced: set[int] = set()
        #: this iteration's globally unused set, when it was needed before the end.
        self._found: set[int] | None = None
        #: every iteration so far left the same parameters unused (PyTorch's
        #: ``ddp_graph_static``, compared from the second iteration on).
        self.graph_static = True
        self._previous: list[int] | None = None

    def prepare(self, unused: list[int], static_graph: bool) -> None:
        """Start an iteration with the caller's unused set (a static graph's learned one wins)."""
        self.local = self.static if static_graph and self.static is not None else unused
        self._pending = None
        self._found = None
        if not static_graph and self.graph_static:
            if self._previous is not None:
                self.graph_static = self._previous == unused
            self._previous = unused

    @property
    def last_sum(self) -> np.ndarray | None:
        """The last summed used map (None before the first)."""
        return self._last_sum

    @property
    def current(self) -> list[int]:
        """The parameters treated as unused on this rank in this iteration."""
        return self.local if self.static is None else self.static

    def learn(self, missing: Sequence[int]) -> list[int]:
        """Keep a static graph's unused set: the parameters its first iteration left out."""
        self.static = list(missing)
        return self.static

    def rebuild_order(self, ready_order: Sequence[int]) -> list[int]:
        """The order DDP rebuilds its buckets from, given an iteration's ready order.

        The caller records it after a normal iteration only: DDP's hooks record nothing
        in a static graph's first (delayed) iteration, so its buckets are rebuilt from
        the second iteration, one iteration later than without a static graph. There
        the unused parameters go last, in index order (DDP appends them when the last
        bucket is ready), not first where this reducer marks them. Where the buckets
        lie decides how the allreduce splits them, so the sums' rounding too: any other
        order gives gradients that differ from DDP's in the last bits (3 ranks or more).
        """
        if self.static is None:
            return list(ready_order)
        unused = set(self.static)
        return [i for i in ready_order if i not in unused] + sorted(unused)

    def launch(
        self,
        comm: Comm,
        ops: ArrayOps,
        like: Any,
        *,
        find_unused: bool,
        static_graph: bool,
        used_nothing: bool = False,
    ) -> None:
        """Start the used-map allreduce once every bucket is launched (DDP overlaps it too).

        ``used_nothing``: this rank took no part (a joined rank shadowing the others):
        it sends the last summed map instead (PyTorch's joined rank does).
        """
        if self._pending is not None or self._found is not None:
            return  # launched, or already summed this iteration
        if not self._searched(find_unused, static_graph):
            return
        if used_nothing:
            last = self._last_sum
            used = np.zeros(self.num_params, dtype=np.int32) if last is None else last.copy()
        else:
            used = np.ones(self.num_params, dtype=np.int32)
            used[list(self.current)] = 0
            used[sorted(self.used_unsynced)] = 1
        self.used_unsynced.clear()
        self._pending = comm.allreduce(ops.from_numpy(used, like))

    def on_every_rank(
        self,
        comm: Comm,
        ops: ArrayOps,
        like: Any,
        *,
        find_unused: bool,
        static_graph: bool,
        used_nothing: bool = False,
        keep: bool = False,
    ) -> set[int]:
        """Parameters that no rank used this iteration (their gradients stay untouched).

        Only searched when parameters may be unused; then the per-rank used maps are
        summed with one extra allreduce, as DDP does (once, for a static graph), started
        by :meth:`launch` when the last bucket went out, or here. A joined rank passes
        ``used_nothing`` and keeps the same state as the ranks still training, so it
        enters exactly the collectives they do. The sum is kept for a joined rank's map.
        ``keep``: the set is needed again this iteration (read early, to skip buckets).
        """
        if self._found is not None:
            found, self._found = self._found, self._found if keep else None
            return found
        if not self._searched(find_unused, static_graph):
            return set() if self._static_global is None else self._static_global
        self.launch(
            comm,
            ops,
            like,
            find_unused=find_unused,
            static_graph=static_graph,
            used_nothing=used_nothing,
        )
        work, self._pending = self._pending, None
        assert work is not None
        total = np.array(ops.to_numpy(work.wait()), dtype=np.int32)  # a copy
        self._last_sum = total
        found = {i for i, count in enumerate(total.tolist()) if not count}
        if static_graph:
            self._static_global = found
        if keep:
            self._found = found
        return found

    def _searched(self, find_unused: bool, static_graph: bool) -> bool:
        if static_graph:
            return self._static_global is None
        return find_unused
