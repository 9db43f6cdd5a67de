"""The store keys a context leaves for later: deleted at the exit of a later clean context.

A key a peer may still read cannot be deleted when this rank is done with it: a reader
looks a key up (``check``), then reads it (``get``), and a c10d ``get`` of a key deleted
in between blocks for the store's whole timeout, so a deletion at the wrong moment turns
a clean error into a hang. A failed context's keys (the failure tickets, the forward
headers a peer's failure path reads to answer them, the ledger records a probe reads,
the exit counter) and a clean one's probe records are read by peers until they leave
that context, which this rank cannot see. A later context's exit barrier can: past it,
every rank of the group reached that context's exit, so every rank left every earlier
context of the group (a rank has one open per group, and contexts pair up in order),
and none reads their keys any more.

So each rank keeps the keys it wrote in a context that it cannot delete at that
context's exit, and deletes them past the barrier of its next clean context; the
group's lowest rank deletes the shared exit counters. A failed context then costs the
store nothing once a context works again (a retry loop that catches the error does not
grow it), and a clean context pays nothing more than a dictionary lookup.
"""

from __future__ import annotations

from xgrad.failure import KeyValueStore

__all__ = ["keep", "sweep"]

#: group name -> keys this rank wrote in earlier contexts, to delete past a later barrier.
_kept: dict[str, list[str]] = {}
#: group name -> the last context whose exit counter the lowest rank deleted.
_swept: dict[str, int] = {}


def keep(name: str, keys: list[str]) -> None:
    """Keep ``keys`` of group ``name`` for the next clean context's exit to delete."""
    if keys:
        _kept.setdefault(name, []).extend(keys)


def sweep(name: str, store: KeyValueStore, base: str, seq: int, *, lowest: bool) -> None:
    """Past the exit barrier of context ``seq`` of group ``name``: delete what earlier
    contexts left (``base``: the contexts' namespace without the number).

    The lowest rank deletes the exit counters of every earlier context not deleted yet
    (the one before only, after clean contexts); ``seq``'s own counter is left to the
    next (a slower rank may still read it in its barrier)."""
    for key in _kept.pop(name, ()):
        store.delete_key(key)
    if lowest:
        for s in range(_swept.get(name, 0) + 1, seq):
            store.delete_key(f"{base}/{s}/exit")
        _swept[name] = seq - 1
