"""A context per step does not grow the store: what a clean context wrote is deleted, and
what a failed one wrote is deleted at the next clean one.

Each context used to leave its exit counter and one forward header per send in the
group's store for the rest of the run (a training loop opening a context per step grew
the store, which lives in rank 0's process, by a key per send and step), and a failed
context its failure tickets, headers and ledger records too (a loop that catches
``DistBackwardError`` and goes on grew it by 7 keys a failure on three ranks). Counted
with the store's own ``num_keys`` on three real gloo ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from failing import failing_function
from ranks import key_count, run_ranks

Boom = failing_function("Boom", lambda: ValueError("boom in backward"))


@contextlib.contextmanager
def _no_probes() -> Iterator[None]:
    """Contexts whose keys are counted write no probe records of their own: a wait that
    lasts ``PROBE_AFTER`` (a rank that starts late, a loaded machine) writes one, kept
    until the next clean context, and the count then depended on the machine's speed."""
    from xgrad.torch_backend import dist_ledger

    saved, dist_ledger.PROBE_AFTER = dist_ledger.PROBE_AFTER, 3600.0
    try:
        yield
    finally:
        dist_ledger.PROBE_AFTER = saved


def _keys(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    store = dist.distributed_c10d._get_default_store()
    w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w.requires_grad_()

    def step(fail: bool = False) -> torch.Tensor:
        with da.context(timeout=20.0) as cid:
            if rank == 0:  # fan-out to every peer, and each sends a result back
                for peer in range(1, world):
                    da.send(w * peer, peer)
                roots = [sum(da.recv(peer).sum() for peer in range(1, world))]
            else:
                t = da.recv(0)
                if fail:
                    raise RuntimeError(f"rank {rank} failed on purpose")
                da.send(t @ w, 0)
                roots = []
            da.backward(cid, roots)
            return da.get_gradients(cid)[w]

    with _no_probes():
        out: dict[str, Any] = {"grads": [step()]}
        out["after_1"] = key_count(store)
        out["grads"] += [step() for _ in range(6)]
        out["after_7"] = key_count(store)
    try:
        step(fail=rank == 1)
        out["failed"] = None
    except Exception as exc:  # every rank raises the failure of rank 1
        out["failed"] = type(exc).__name__
    with _no_probes():
        out["grads"] += [step()]
        out["after_failure"] = key_count(store)
        out["grads"] += [step() for _ in range(6)]
        out["after_failure_7"] = key_count(store)
    first = out.pop("grads")
    out["same_grads"] = all(torch.equal(g, first[0]) for g in first)
    return out


def test_clean_contexts_leave_no_keys_in_the_store() -> None:
    results, codes = run_ranks(_keys, 3, timeout=120)
    assert set(codes.values()) == {0}, (codes, results)
    for rank, (status, out) in sorted(results.items()):
        assert status == "ok", (rank, out)
        assert out["after_7"] == out["after_1"], (
            rank,
            out,
        )  # was 5 more keys a context (4 headers, 1 counter)
        assert out["after_failure_7"] == out["after_failure"], (rank, out)
        assert out["failed"] is not None and out["same_grads"], (rank, out)


def _failed_keys(rank: int, world: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    store = dist.distributed_c10d._get_default_store()
    w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w.requires_grad_()

    def step(fail: str = "", slow: bool = False) -> torch.Tensor:
        with da.context(timeout=20.0) as cid:
            if slow and rank == 1:
                time.sleep(0.4)  # rank 0's recv lasts past PROBE_AFTER: probes write records
            if rank == 0:
                for peer in range(1, world):
                    da.send(w * peer, peer)
                roots = [sum(da.recv(peer).sum() for peer in range(1, world))]
            else:
                t = da.recv(0)
                da.send(Boom.apply(t) @ w if fail == "node" and rank == 1 else t @ w, 0)
                roots = []
            if fail == "misuse" and rank == 2:
                return w  # leaves without backward: the others' probes write their records
            da.backward(cid, roots)
            return da.get_gradients(cid)[w]

    with _no_probes():
        out: dict[str, Any] = {"grads": [step(), step()], "failed": []}
        out["clean"] = key_count(store)
    out["after"] = []
    for i in range(rounds):
        kind = ("node", "misuse")[i % 2]
        try:  # probes on: the misuse is diagnosed from them
            step(fail=kind)
            out["failed"].append(None)
        except da.DistBackwardError as exc:
            out["failed"].append(f"{kind}: {exc}")
        with _no_probes():
            out["grads"].append(step())
            out["after"].append(key_count(store))
    out["slow"] = []
    for _ in range(3):
        out["grads"].append(step(slow=True))
        out["slow"].append(key_count(store))
    first = out.pop("grads")
    out["same_grads"] = all(torch.equal(g, first[0]) for g in first)
    return out


def test_failed_contexts_leave_no_keys_once_a_context_works_again() -> None:
    rounds = 4
    results, codes = run_ranks(_failed_keys, 3, (rounds,), timeout=120)
    assert set(codes.values()) == {0}, (codes, results)
    for rank, (status, out) in sorted(results.items()):
        assert status == "ok", (rank, out)
        assert all(out["failed"]), (rank, out)  # every failure raised on every rank
        assert "BoomBackward" in out["failed"][0] and "backward" in out["failed"][1], out
        # After each failed context and a clean one the store holds what it held after
        # clean contexts only (the heartbeats, the last context's exit counter): nothing
        # of the failed ones is left (was 7 more keys a failure).
        assert out["after"] == [out["clean"]] * rounds, (rank, out)
        # A clean context whose waits lasted leaves the probe records a slower peer may
        # still read; the next clean context deletes them (they were never deleted).
        # How many ranks probe in a slow context depends on the machine's load (rank 1's
        # peers always do, rank 1 when it is slow too): bounded, not growing.
        assert max(out["slow"]) <= out["clean"] + 3, (rank, out)
        assert out["same_grads"], (rank, out)
