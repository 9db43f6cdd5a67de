"""The store keys of a failed DDP step: deleted once every rank has read them.

A failed step leaves its failure tickets in its namespace of the failure channel, and
every rank reads them at the forward pass that begins the next step
(:meth:`~.ddp_failure.StepWatch.begin_step`: that is how every rank learns the step
failed and moves to a fresh private group). They cannot be deleted before every rank
has: a reader looks a key up, then gets it, and a c10d ``get`` of a key deleted in
between blocks for the store's whole timeout, while a key gone before the lookup would
make that rank miss the failure and keep the group the others dropped. Nor is it known
when a slow rank reads (the step after a failure need not need every rank: it may fail
too, before its reduction). So each rank, past that read and with its new group made,
marks it in the failed step's namespace (one write per rank and failed step; a good step
writes nothing), and the group's lowest rank, at each step's start while such a step is
pending, looks the marks up (one lookup) and, once every rank's is there, deletes the
step's keys: its tickets, their counter and the marks, and what c10d wrote to make the
fresh group (:mod:`.group_keys`). Under ``join()`` each rank also marks, before it makes
the fresh group, that it makes it (:func:`mark_next`: a rank that has joined makes it
ahead of the others, and waits for theirs, :mod:`.join_leave`), deleted with the rest.
A training loop that catches a failed step and goes on keeps a bounded store: usually
two steps after a failure (the step after it needs every rank for its reduction, so
each marked) the keys are gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xgrad.torch_backend.group_keys import group_keys

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch

__all__ = [
    "carried_key",
    "counts_keys",
    "drop_read_failures",
    "given_up_key",
    "mark_next",
    "mark_read",
    "next_marks",
    "read_failure",
]


def _marks(prefix: str, ranks: list[int]) -> list[str]:
    return [f"{prefix}/read/{r}" for r in ranks]


def carried_key(prefix: str) -> str:
    """The key of a step (namespace ``prefix``) whose failure is the step before's,
    carried over (:func:`~.join_leave.carried_over`)."""
    return f"{prefix}/carried"


def counts_keys(prefix: str, ranks: list[int]) -> list[str]:
    """The keys of the ranks' ``no_sync`` pass counts in a failed step's namespace
    (:mod:`.ddp_which_step`)."""
    return [f"{prefix}/passes/{r}" for r in ranks]


def given_up_key(prefix: str) -> str:
    """The key of a step (namespace ``prefix``) a rank still training under ``join()``
    gave up whole in an accumulation (a pipeline step that failed,
    :func:`~.ddp_give_up.abandon_step`): its next pass sends no count standing in for
    the step's synchronised pass, which a joined rank would otherwise wait for
    (:meth:`~.join_failed.FailedSteps.drop_failed_step`) while that pass waits for the
    joined rank's mark, each to the timeout."""
    return f"{prefix}/given_up"


def next_marks(prefix: str, ranks: list[int]) -> list[str]:
    """The keys of :func:`mark_next` of ``ranks`` in the failed step's namespace ``prefix``."""
    return [f"{prefix}/next/{r}" for r in ranks]


def mark_next(watch: StepWatch) -> None:
    """Under ``join()``: this rank begins the step after its failed one (``watch``'s
    step) and makes the fresh group now; written before it makes the group."""
    watch.channel.store.set(f"{watch.channel.prefix}/next/{watch.channel.rank}", b"1")


def read_failure(watch: StepWatch, prefix: str, mark: bool = True) -> None:
    """This rank read the failure of the step in namespace ``prefix`` and will not read
    that namespace again (its channel is the next step's), and made the fresh private
    group: say so there. ``mark=False``: it still reads the ranks' pass counts there,
    and marks it then (:func:`mark_read`, :mod:`.ddp_which_step`)."""
    if mark:
        mark_read(watch, prefix)
    if watch.channel.rank == watch.lowest:
        watch.failed_steps.append((prefix, group_keys(watch.group)))


def mark_read(watch: StepWatch, prefix: str) -> None:
    """This rank is done with the failed step's namespace ``prefix``."""
    watch.channel.store.set(f"{prefix}/read/{watch.channel.rank}", b"1")


def drop_read_failures(watch: StepWatch) -> None:
    """On the lowest rank: delete the keys of each failed step every rank has read."""
    store = watch.channel.store
    while watch.failed_steps:
        prefix, made = watch.failed_steps[0]
        marks = _marks(prefix, watch.ranks)
        if not store.check(marks):
            return  # a rank has not begun a later step yet: looked up again next step
        watch.failed_steps.pop(0)
        # Every poster took its ticket before it marked (a rank posts to a step only
        # until it begins the next), so the counter is final.
        counter = f"{prefix}/failures"
        tickets = int(store.get(counter)) if store.check([counter]) else 0
        tickets_keys = [f"{prefix}/failure/{t}" for t in range(1, tickets + 1)]
        # (the next marks and the carried key of a step failed outside join(), or not
        # carried over, were never written: no-ops)
        extra = [
            *next_marks(prefix, watch.ranks),
            carried_key(prefix),  # (join_leave's)
            given_up_key(prefix),  # (ddp_give_up's)
            *counts_keys(prefix, watch.ranks),  # (ddp_which_step's)
        ]
        for key in [*tickets_keys, counter, *marks, *extra]:
            store.delete_key(key)
        made.delete()  # every rank made the fresh group before it marked
