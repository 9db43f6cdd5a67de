"""ZB-V and the list scheduler behind ZB-H2 and ``from_invocations``: the exact orders they
generated before they were made near-linear in p, and their time at p = 1000, m = 1.

Both took time quadratic in p whatever m: ZB-V built every rank's order for max(m, 2p-1)
microbatches and cut it to m; the list scheduler visited every rank at every tick of its
clock and scanned every stage for the end (11 s and 5.6 s at p = 1000, m = 1).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable

import pytest

import xgrad.pipeline as xp


def _digest(
    build: Callable[[int, int], xp.Schedule],
    ps: Iterable[int],
    ms: Iterable[int],
    text: Callable[[xp.Schedule], str] = xp.schedule_to_csv,
) -> str:
    h = hashlib.sha256()
    for p in ps:
        for m in list(ms):
            h.update(text(build(p, m)).encode())
    return h.hexdigest()


#: sha256 of the CSV texts, p and m in order, computed with the code before the change.
PINNED = {
    "zbv": (
        range(1, 9),
        range(1, 17),
        "80b20e072ee844af2a99d4282f546406ca23ca9f5c383957aa0a56710c1f9995",
    ),
    "zb_h2": (
        range(1, 9),
        range(1, 17),
        "82765b9900b9bcf1821af643fd3b6c6df25422c1caee2a4c887b04e3b201cbbb",
    ),
}
BIG = {  # m below, at and above 2p-1, where ZB-V's cut and the scheduler's drain differ
    "zbv": "f9673b71b0d39b0f07cc9a72be8aaf930b02af2b8e337076b5a366b2886b11e7",
    "zb_h2": "de27c52c77add081c46fc999f5ba563fbe327fa8aeee8e238856cc212fe891f9",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_orders_as_before(name: str) -> None:
    ps, ms, pinned = PINNED[name]
    assert _digest(getattr(xp, name), ps, ms) == pinned
    assert _digest(getattr(xp, name), (20, 33), (1, 7, 40, 70)) == BIG[name]


_DAG = xp.dag([(0, 0), (1, 0), (2, 0), (0, 1)], [(), (0,), (1, 0), (2, 1)])
_LOOP = xp.chain([(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)])
INVOCATIONS = {  # schedule.text() (it keeps a DAG's inputs), m = 1..16
    ("gpipe", "dag"): "236f43fe3cdb119c24629a94b88822ea682e2b6a3378093926d5c6359bdb0027",
    ("gpipe", "loop"): "4c0c33924fe734f7a6c01ef55e926edf6cd44806a52e3a7026b27783261e0ecb",
    ("1f1b", "dag"): "9c3b7ce7a3e74a40363f6434fd5ed16429768f6790a3b0aa4f0658008bff102a",
    ("1f1b", "loop"): "e2f196df86f8579ee57e9b2015c9881b717e3a35c8eb69fa96f470ab26c4e1c6",
    ("zb", "dag"): "93e5aa3f83e3443e1587a39e775f1b1b42e810705b2d41b0ff6d45df17c3dfc2",
    ("zb", "loop"): "23e7e2432df5f92eaa31ce97db2a41af07f0137bf1989be5d0a950d01df12b8a",
}


@pytest.mark.parametrize(("policy", "shape"), sorted(INVOCATIONS))
def test_invocation_orders_as_before(policy: str, shape: str) -> None:
    inv = _DAG if shape == "dag" else _LOOP
    got = _digest(
        lambda p, m: xp.from_invocations(inv, m, policy), (0,), range(1, 17), xp.Schedule.text
    )
    assert got == INVOCATIONS[policy, shape]


@pytest.mark.parametrize("name", ["zbv", "zb_h2"])
def test_large_p_is_fast(name: str) -> None:
    # Before: 11 s (ZB-V) and 5.6 s (ZB-H2) on a 2-core machine; after: 0.06 s and 0.12 s.
    # The bound is a quarter of the old time, for a loaded machine.
    start = time.perf_counter()
    s = xp.make(name, 1000, 1)
    elapsed = time.perf_counter() - start
    assert sum(map(len, s.actions)) == (6000 if name == "zbv" else 3000)
    assert elapsed < (2.8 if name == "zbv" else 1.4), (
        f"{name} at p = 1000, m = 1 took {elapsed:.1f} s"
    )


def test_a_stalling_order_is_an_error_not_a_hang() -> None:
    # Rank 1 holds stages 0, 4 and 5: at m = 7 under "1f1b" (at most 6 activation sets
    # per rank) no rank can run anything. The list scheduler ticked on for ever (found by
    # comparing the two schedulers on random placements); driven by events, it runs out
    # of them and says so.
    inv = xp.chain([(1, 0), (0, 0), (0, 1), (0, 2), (1, 1), (1, 2)])
    xp.from_invocations(inv, 6, "1f1b")
    with pytest.raises(ValueError, match=r"list scheduling stalls at tick \d+: no rank can run"):
        xp.from_invocations(inv, 7, "1f1b")
    for policy in ("gpipe", "zb"):
        xp.validate(xp.from_invocations(inv, 7, policy))
