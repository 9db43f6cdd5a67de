"""``ring``: an xgrad backend that lives outside xgrad (a new collective library).

Ranks are threads; an allreduce is a ring (reduce-scatter, then all-gather), each rank
talking only to its neighbours. xgrad's reducer, engine and bucket plans do the rest, so
this package is the three things a backend provides (see ``xgrad.backend.Backend``):

- ``runners()``: ways to run a data-parallel step (here one, :class:`RingRunner`);
- ``run_ranks(fn, world_size, timeout=...)``: ``fn(comm)`` on every rank, with ``comm``
  an :class:`xgrad.backend.Comm` (here :class:`RingComm`);
- ``array_ops()``: the reducer's array operations (NumPy's, from xgrad).

It is registered by one line of ``pyproject.toml`` (the ``xgrad.backends`` entry point),
after which ``xgrad backends`` lists it and ``xgrad crosscheck --backends ring`` runs it
(being an example, it sets ``BY_DEFAULT = False``: a plain ``xgrad crosscheck`` leaves it
out).
"""

from __future__ import annotations

from xgrad_ring.comm import RingComm as RingComm
from xgrad_ring.comm import RingError as RingError
from xgrad_ring.comm import run_ranks as run_ranks
from xgrad_ring.runner import RingRunner as RingRunner
from xgrad_ring.runner import array_ops as array_ops
from xgrad_ring.runner import runners as runners

name = "ring"

#: an example: it runs when named (``--backends ring``), not in every default crosscheck.
BY_DEFAULT = False


def available() -> bool:
    """Always: the ring needs only NumPy and threads."""
    return True
