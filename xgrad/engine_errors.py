"""The errors of a backward pass: where it failed, on which worker, in which context.

Kept apart from the engine so that whatever reports a failed pass (the engine, a
distributed context, a backend's own distributed autograd) raises the same types; they are
re-exported by :mod:`xgrad.engine`.
"""

from __future__ import annotations

__all__ = ["BackwardError", "DistBackwardError"]


class BackwardError(RuntimeError):
    """A node failed during a backward pass; the pass was stopped and its state dropped.

    Attributes:
        node: the failing node's id, or -1 when the failure was not inside a node (a timeout).
        node_name: its label.
        worker: the worker it happened on (None in a local pass).
        message: the original error's text.
    """

    def __init__(self, node: int, node_name: str, message: str, worker: int | None = None):
        self.node = node
        self.node_name = node_name
        self.message = message
        self.worker = worker
        where = "" if worker is None else f" on worker {worker}"
        at = "" if node < 0 else f" at node {node} ({node_name})"
        super().__init__(f"backward pass failed{where}{at}: {message}")


class DistBackwardError(BackwardError):
    """Raised on every worker of a distributed pass when any of them failed.

    ``worker`` is the worker the error came from; ``context_id`` the pass; ``raised_on``
    the worker that raises this copy.
    """

    def __init__(
        self, context_id: int, raised_on: int, node: int, node_name: str, message: str, worker: int
    ):
        self.context_id = context_id
        self.raised_on = raised_on
        super().__init__(node, node_name, f"(context {context_id}) {message}", worker)
