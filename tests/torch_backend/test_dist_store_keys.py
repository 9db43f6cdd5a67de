"""A context per step does not grow the store: what a clean context wrote is deleted.

Each context used to leave its exit counter and one forward header per send in the
group's store for the rest of the run (a training loop opening a context per step grew
the store, which lives in rank 0's process, by a key per send and step). Counted with the
store's own ``num_keys`` on three real gloo ranks, over clean contexts, then around a
failed one (whose keys stay, a peer may still read them, but do not grow the next ones).
"""

from __future__ import annotations

from typing import Any

from ranks import run_ranks


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

    def count() -> int:
        dist.barrier()
        n = int(store.num_keys())
        dist.barrier()
        return n

    out: dict[str, Any] = {"grads": [step()]}
    out["after_1"] = count()
    out["grads"] += [step() for _ in range(6)]
    out["after_7"] = count()
    try:
        step(fail=rank == 1)
        out["failed"] = None
    except Exception as exc:  # every rank raises the failure of rank 1
        out["failed"] = type(exc).__name__
    out["grads"] += [step()]
    out["after_failure"] = count()
    out["grads"] += [step() for _ in range(6)]
    out["after_failure_7"] = count()
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
