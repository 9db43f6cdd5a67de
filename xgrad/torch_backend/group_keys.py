"""The keys c10d wrote to the store to make a gloo process group, to delete once all made it.

Making a gloo group, each member writes its listening address to the group's namespace
of the store, and reads every other member's to connect to it; c10d never deletes those
keys (``destroy_process_group`` neither). A runtime that replaces its private group after
every failed step (the DDP, the pipeline) would grow the store by one key per rank and
failure. Once every member has made the group (connected), nobody reads them again, so
the runtime deletes them at a point where it knows that (:mod:`.ddp_leftovers`,
:mod:`.pipeline_group`).

The keys are named by c10d and gloo, not by xgrad: ``<device>//<gloo device>/<group
rank>`` in the group's store, as PyTorch 2 writes them for every device gloo serves
(one gloo device: index 0). A name that does not match any more only leaves that key
(a deletion of a missing key does nothing); groups of other backends (NCCL) and gloo
groups that connect lazily (``TORCH_GLOO_LAZY_INIT``: the keys are read at the group's
first use, maybe on one rank long after the others) are left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist

from xgrad.failure import KeyValueStore

__all__ = ["StoreKeys", "group_keys"]


@dataclass(frozen=True)
class StoreKeys:
    """Keys of one store, to delete later (the store is kept: a group's may be gone)."""

    store: KeyValueStore | None
    keys: tuple[str, ...]

    def delete(self) -> None:
        """Delete them: only once nobody reads them (for a group's: every member made it)."""
        if self.store is not None:
            for key in self.keys:
                self.store.delete_key(key)


def group_keys(group: Any, rank: int | None = None) -> StoreKeys:
    """The rendezvous keys of ``group`` (none for a group that is not an eager gloo one);
    with ``rank`` (a group rank), only the one that rank wrote."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return StoreKeys(None, ())
    c10d = dist.distributed_c10d
    try:  # private to c10d: a torch without them leaves the keys, as before
        config = str(c10d._world.pg_backend_config.get(group, ""))
        store = cast(KeyValueStore, c10d._get_process_group_store(group))
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return StoreKeys(None, ())
    devices = [d for d, _, b in (p.partition(":") for p in config.split(",")) if b == "gloo"]
    if not devices:
        return StoreKeys(None, ())
    ranks = range(dist.get_world_size(group)) if rank is None else [rank]
    return StoreKeys(store, tuple(f"{d}//0/{r}" for d in devices for r in ranks))
