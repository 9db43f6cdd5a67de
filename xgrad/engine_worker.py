"""One worker's part of a distributed backward pass, and how it ends, whatever runs it.

A node's error is named by its node (:func:`node_error`; a ``KeyboardInterrupt`` or a
``SystemExit`` is marked with it, :func:`mark_node`, and stays what it is), and
:func:`run_worker_part` posts the first error of a worker's part to every worker of the
pass, finishes the part on success and releases it either way. Kept apart from the
engine (:mod:`xgrad.engine`, which re-exports :func:`run_worker_part`) because another
executor ends its passes the same way: the torch backend's waves run a rank's part on
torch's own engine and hand it here, so both raise the same errors on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from xgrad.engine_errors import BackwardError, DistBackwardError
from xgrad.failure import describe
from xgrad.graph import BackwardGraph

__all__ = ["mark_node", "node_error", "run_worker_part"]

_T = TypeVar("_T")


def node_error(graph: BackwardGraph, u: int, exc: Exception, worker: int | None) -> BackwardError:
    """The error of node ``u`` (its function, or a deferred part of it) raising ``exc``."""
    return BackwardError(u, graph.name(u), describe(exc), worker)


def mark_node(exc: BaseException, graph: BackwardGraph, u: int) -> None:
    """Note on ``exc`` (a ``KeyboardInterrupt``, a ``SystemExit``: not an ``Exception``,
    so it stays what it is on this worker) the node it came from, for the others."""
    if not hasattr(exc, "_xgrad_node"):
        exc._xgrad_node = (u, graph.name(u))  # type: ignore[attr-defined]


def run_worker_part(ctx: Any, worker: int, body: Callable[[], _T]) -> _T:
    """Run one worker's part of a distributed pass with the pass's ending, whatever runs it.

    ``ctx`` is a :class:`~xgrad.dist_context.DistContext` or anything with its
    ``fail``/``finish``/``release`` (the torch backend's per-process pass). A node's error
    is posted named by its node, any other error as the worker's (a bad graph or link: the
    others must not wait for this worker), a ``KeyboardInterrupt`` or ``SystemExit`` too,
    though it is raised here as it is; a success finishes the part (every worker done); the
    part is released either way.
    """
    try:
        try:
            out = body()
        except DistBackwardError:
            raise
        except BackwardError as exc:
            raise ctx.fail(worker, exc.node, exc.node_name, exc.message) from exc
        except Exception as exc:
            raise ctx.fail(worker, -1, "", describe(exc)) from exc
        except BaseException as exc:
            # Ctrl-C or exit inside the pass: posted (the others stop at once, told where),
            # then raised here as it is.
            node, name = getattr(exc, "_xgrad_node", (-1, ""))
            ctx.fail(worker, node, name, describe(exc))
            raise
        ctx.finish(worker)
        return out
    finally:
        ctx.release(worker)
