"""What PyTorch's reducer lets its own tests read: whether the graph stayed static, the used map.

PyTorch's DDP tests call ``ddp.reducer._ddp_graph_static()`` and
``ddp.reducer._get_local_used_map()``; scripts that check whether ``static_graph=True``
would be safe do too. Kept apart from the state machine in :mod:`xgrad.reducer` (whose class
mixes this in): nothing here runs per gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from xgrad.reducer_errors import prior_reduction_unfinished

if TYPE_CHECKING:
    from xgrad.backend import Comm
    from xgrad.reducer_types import ArrayOps
    from xgrad.reducer_unused import UnusedParams


class Inspection:
    """Mixed into :class:`~xgrad.reducer.Reducer`; uses its state (declared below)."""

    params: list[Any]
    names: list[str]
    comm: Comm
    ops: ArrayOps
    static_graph: bool
    find_unused_parameters: bool
    _unused: UnusedParams
    #: the "prior iteration" error names the parameters (PyTorch does so when
    #: ``TORCH_DISTRIBUTED_DEBUG`` is INFO or DETAIL; the torch DDP sets this from it).
    name_unreduced: bool = True

    if TYPE_CHECKING:  # the reducer's (a stub here would shadow it)

        def _missing(self) -> list[int]: ...

    def prior_reduction_error(self) -> RuntimeError:
        """PyTorch's "Expected to have finished reduction in the prior iteration" error for
        the parameters the current pass still waits for."""
        return prior_reduction_unfinished(
            self._missing(),
            self.names,
            self.comm.rank,
            static_graph=self.static_graph,
            find_unused=self.find_unused_parameters,
            name_params=self.name_unreduced,
        )

    def _ddp_graph_static(self) -> bool:
        """Whether every iteration so far left the same parameters unused (PyTorch's
        ``ddp_graph_static``: then ``static_graph=True`` would do)."""
        return self._unused.graph_static

    def _get_local_used_map(self) -> Any:
        """The last summed used map, per parameter how many ranks used it (int32; zeros
        before the first sum), as PyTorch's reducer keeps it after its allreduce."""
        last = self._unused.last_sum
        used = np.zeros(len(self.params), dtype=np.int32) if last is None else last.copy()
        return self.ops.from_numpy(used, self.params[0])
