"""A peer that caught a rank's "left after N contexts" opens another context on that group.

Two gloo ranks, two groups: the default one and ``g = new_group([0, 1])``. Rank 1 runs
one context on ``g``, then destroys ``g`` (it leaves that group, posting that it left
after 1 context, :mod:`~xgrad.torch_backend.dist_left`) and runs a context on the default
group. Rank 0 opens ``g``'s context 2, where it raises the leave at once, catches it,
and opens ``g``'s context 3, then the default group's context.

Before, context 3 waited for rank 1 (the post was on context 2's channel only) and named
it a heartbeat timeout later as a rank that "stopped answering". Now it raises the same
"left after 1 distributed autograd context" error at once, and the default group, where
no rank left, runs its context as before (nothing kept for it).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ranks import run_ranks

#: rank 1's leave, named at once, where the heartbeat (its default, 10 s) takes far longer
PROMPT = 2.5
LEFT = (
    "Error on rank 1: left after 1 distributed autograd context on process group '{name}' "
    "(it destroyed the group with destroy_process_group): it never enters the group's "
    "context 2"
)


def _step(rank: int, da: Any, group: Any) -> list[float]:
    """One context on ``group``: rank 1 sends ``w * 3`` to rank 0, which receives it; the
    gradient of rank 0's weight (rank 1: [])."""
    import torch

    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with da.context(group, timeout=20) as cid:
        if rank == 0:
            loss = (da.recv(1) * w * 2).sum()
            da.backward(cid, [loss])
            return da.get_gradients(cid)[w].tolist()
        da.send(w * 3, 0)
        da.backward(cid, [])
        return []


def _again(rank: int, world: int) -> Any:
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da
    from xgrad.torch_backend import dist_left

    g = dist.new_group([0, 1])
    name = str(dist.distributed_c10d._get_process_group_name(g))
    out: dict[str, Any] = {"name": name, "first": _step(rank, da, g)}
    if rank == 1:
        time.sleep(0.3)
        dist.destroy_process_group(g)
        out["default"] = _step(rank, da, None)
        return out
    for label in ("second", "third", "fourth"):
        start = time.monotonic()
        try:
            _step(rank, da, g)
            out[label] = "no error"
        except da.DistBackwardError as exc:
            out[label] = (str(exc), exc.rank, type(exc).__name__, time.monotonic() - start)
    out["default"] = _step(rank, da, None)
    out["kept"] = sorted(dist_left._gone)
    return out


def test_each_later_context_on_the_group_raises_the_leave_at_once() -> None:
    results, codes = run_ranks(_again, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    (status, out), (status1, out1) = results[0], results[1]
    assert status == status1 == "ok", results
    left = LEFT.format(name=out["name"])
    second = out["second"]
    assert second[0].startswith(left), second
    for label in ("third", "fourth"):  # caught, and the group opened again
        text, origin, kind, seconds = out[label]
        assert text == second[0], (label, out[label])
        assert (origin, kind) == (1, "DistBackwardUnresponsiveError"), out[label]
        assert seconds < PROMPT, (label, out[label])
    # the default group, where no rank left: its context ran as before, nothing kept
    assert out["first"] == out["default"] == [6.0] * 3, out
    assert out1["default"] == [], out1
    assert out["kept"] == [out["name"]], out


def _ids(rank: int, world: int) -> list[int]:
    """The ids of three contexts this rank opens one after another (each a step)."""
    from xgrad.torch_backend import dist_autograd as da

    ids = []
    for _ in range(3):
        with da.context(timeout=20) as cid:
            ids.append(cid)
        _step(rank, da, None)
    return ids


def test_the_check_for_a_peers_leave_draws_no_context_id() -> None:
    """The check before each context draws an id only when it raises: the ids of the
    contexts that open stay consecutive (every other one was drawn and dropped)."""
    results, codes = run_ranks(_ids, 2, timeout=60)
    assert set(codes.values()) == {0}, results
    for rank in range(2):
        word, ids = results[rank]
        assert word == "ok", results
        assert [b - a for a, b in itertools.pairwise(ids)] == [2, 2], ids  # a _step between
