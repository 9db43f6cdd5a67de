"""Distributed autograd contexts labelled with their step, on gloo ranks.

Contexts pair up across ranks in the order each rank opens them. A rank that skips a
context (a step it left out without calling anything) pairs its next one with the
others' current one: unlabelled, its tensors and gradients are those of the step before
on the others, every number one step off, without a word. Labelled
(``context(step=...)``), every tensor carries the label and every receive checks it: the
context fails on every rank, naming both ranks and both labels, and the next context
whose labels match works. Without labels nothing changes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from ranks import run_ranks

from xgrad.torch_backend.dist_diagnose import Record, diagnose, step_mismatch

TIMEOUT = 20.0
#: the steps each rank opens a context for: rank 1 skips step 1; after it, step 3 on every
#: rank (the step the ranks go on with once they learnt of the mismatch).
STEPS = {0: [0, 1, 3], 1: [0, 2, 3], 2: [0, 1, 3]}


def _w() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)


def _q(rank: int) -> torch.Tensor:
    return torch.full((3,), float(rank), dtype=torch.float64, requires_grad=True)


def _skipping(rank: int, world: int, labelled: bool) -> dict[str, Any]:
    """Rank 0 sends ``w * (step + 1)`` to ranks 1 and 2, which multiply it by their ``q``.

    Returns, per step each rank opened: what it received (ranks 1, 2), its gradient (rank
    0: of ``w``; the others: of ``q``), or the error it raised.
    """
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    for step in STEPS[rank]:
        w, q = _w(), _q(rank)
        try:
            with da.context(timeout=TIMEOUT, step=step if labelled else None) as cid:
                if rank == 0:
                    for peer in range(1, world):
                        da.send(w * (step + 1), peer)
                    da.backward(cid, [])
                    out[str(step)] = da.get_gradients(cid)[w].tolist()
                else:
                    r = da.recv(0)
                    da.backward(cid, [(r * q).sum()])
                    out[str(step)] = (r.tolist(), da.get_gradients(cid)[q].tolist())
        except da.DistBackwardError as exc:
            out[str(step)] = f"error: {exc}"
    return out


def _good(step: int, world: int) -> dict[int, Any]:
    """Every rank's result of ``step`` run by every rank."""
    w = _w()
    sent = (w * (step + 1)).tolist()
    grads = [sum(float(r) * (step + 1) for r in range(1, world))] * 3
    return {0: grads, **{r: (sent, sent) for r in range(1, world)}}


def test_a_rank_that_skipped_a_labelled_context_is_named_on_every_rank() -> None:
    results, codes = run_ranks(_skipping, 3, (True,), timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    named = re.compile(r"rank 1 is in step 2, (rank 0|ranks 0, 2) in step 1 \(contexts pair up")
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", out
        assert out["0"] == _good(0, 3)[rank], (rank, out)
        failed = out["2" if rank == 1 else "1"]
        assert failed.startswith("error: Error on rank 1 in recv from rank 0: step mismatch: "), (
            rank,
            failed,
        )
        assert named.search(failed), (rank, failed)
        assert out["3"] == _good(3, 3)[rank], (rank, out)  # the next matching step works


def test_without_labels_a_skipped_context_still_pairs_steps_one_off() -> None:
    results, codes = run_ranks(_skipping, 3, (False,), timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    outs = {rank: results[rank][1] for rank in range(3)}
    assert all(results[rank][0] == "ok" for rank in range(3)), results
    # Rank 1's "step 2" received rank 0's step-1 tensor; rank 0's step-1 gradient took
    # rank 1's: unchanged, the numbers silently one step off.
    step1 = _good(1, 3)
    assert outs[1]["2"] == step1[1], outs[1]
    assert outs[0]["1"] == step1[0] and outs[2]["1"] == step1[2], outs
    for rank in range(3):
        assert outs[rank]["0"] == _good(0, 3)[rank]
        assert outs[rank]["3"] == _good(3, 3)[rank]


#: the rank that receives in each step of :func:`_crossed` (the other sends).
RECEIVER = {"a": 0, "b": 1, "c": 0}


def _crossed(rank: int, world: int) -> list[str]:
    """Steps whose transfers differ (step "a": rank 0 receives from rank 1; step "b": rank
    1 from rank 0), rank 1 a step ahead: no header with a label ever arrives, each waits in
    a recv; the ledger's records name the mismatch. Then a matching step works."""
    from xgrad.torch_backend import dist_autograd as da

    out: list[str] = []
    for step in ["a", "c"] if rank == 0 else ["b", "c"]:
        try:
            with da.context(timeout=TIMEOUT, step=step) as cid:
                w = _w()
                if rank == RECEIVER[step]:
                    r = da.recv(1 - rank)
                    da.backward(cid, [(r * w).sum()])
                else:
                    da.send(w * 2, 1 - rank)
                    da.backward(cid, [])
                out.append(str(da.get_gradients(cid)[w].tolist()))
        except da.DistBackwardError as exc:
            out.append(f"error: {exc}")
    return out


def test_labelled_steps_whose_receives_wait_for_each_other_are_named_as_a_mismatch() -> None:
    results, codes = run_ranks(_crossed, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert "step mismatch: rank " in out[0], (rank, out)
        assert re.search(
            r"rank (0 is in step 'a', rank 1 in step 'b'|1 is in step 'b', rank 0 in step 'a')",
            out[0],
        ), out[0]
    # step "c": rank 1 sends 2w, rank 0's root is its w times that: 2w for both
    assert results[0][1][1] == results[1][1][1] == str([2.0, 4.0, 6.0]), results


@pytest.mark.parametrize("step", [1.5, True, b"5", (1,)])
def test_a_step_label_that_is_not_an_int_or_a_str_is_refused(step: Any) -> None:
    from xgrad.torch_backend import dist_autograd as da

    with pytest.raises(TypeError, match=r"step=.* must be an int or a str"), da.context(step=step):
        pass


def test_the_mismatch_names_each_rank_and_label() -> None:
    assert step_mismatch({1: "5", 0: "4"}, 1).startswith(
        "step mismatch: rank 1 is in step 5, rank 0 in step 4 (contexts pair up"
    )
    assert step_mismatch({0: "'a'", 1: None}, 0).startswith(
        "step mismatch: rank 0 is in step 'a', rank 1 in a context without a step ("
    )
    text = step_mismatch({0: "4", 1: "5", 2: "4", 3: "6"}, 1)
    assert text.startswith(
        "step mismatch: rank 1 is in step 5, ranks 0, 2 in step 4, rank 3 in step 6 ("
    )
    assert step_mismatch({0: "4", 1: "4", 2: "5"}, 0).startswith(
        "step mismatch: rank 0 (with rank 1) is in step 4, rank 2 in step 5 ("
    )


def test_records_in_different_steps_name_the_odd_rank_first() -> None:
    records = {
        0: Record("pass", 1, step="4"),
        1: Record("recv", 0, src=0, step="5"),
        2: Record("exit", 1, step="4"),
    }
    assert diagnose(records, [0, 1, 2]) == (
        1,
        "recv from rank 0",
        step_mismatch({0: "4", 1: "5", 2: "4"}, 1),
    )
    assert Record.from_bytes(records[1].to_bytes()) == records[1]
    same = {rank: Record("exit", 1, step="4") for rank in range(2)}
    assert diagnose(same, [0, 1]) is None
