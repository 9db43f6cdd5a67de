"""Generators: literal schedules for small p, m, and validity over a grid of sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xgrad.pipeline as xp


def texts(schedule: xp.Schedule) -> list[str]:
    return [" ".join(str(a) for a in acts) for acts in schedule.actions]


def test_gpipe_literal() -> None:
    assert texts(xp.gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_1f1b_literal() -> None:
    assert texts(xp.one_f_one_b(2, 3)) == ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]
    assert texts(xp.one_f_one_b(3, 2)) == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2B0 2F1 2B1"]


def test_interleaved_literal() -> None:
    s = xp.interleaved_1f1b(2, 2, chunks=2)
    assert s.placement == (0, 1, 0, 1)
    assert texts(s) == ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]
    assert texts(xp.interleaved_1f1b(2, 4, chunks=2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_zero_bubble_literal() -> None:
    assert texts(xp.zb_h1(2, 3)) == [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
    ]
    assert texts(xp.zb_h2(2, 3)) == [
        "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2",
    ]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(xp.SCHEDULES)),
    p=st.integers(1, 6),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
)
def test_every_generated_schedule_is_valid(name: str, p: int, k: int, v: int) -> None:
    m = k * p if name.startswith("interleaved") else k + p // 2
    if name in ("zbv", "dualpipev"):
        v, m = 2, max(m, 2 * p)
    s = xp.make(name, p, m, chunks=v)
    assert s.num_ranks == p and s.num_microbatches == m
    xp.validate(s)
    with_comms = xp.insert_comms(s)
    xp.validate(with_comms)
    assert xp.strip_comms(with_comms) == s


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="num_stages"):
        xp.gpipe(bad, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_microbatches"):
        xp.one_f_one_b(2, bad)  # type: ignore[arg-type]


def test_interleaved_needs_m_to_split_into_rounds() -> None:
    # Like torch: max(1, m // p) rounds, m a multiple of them (m = 10, p = 4 is fine).
    assert xp.interleaved_1f1b(4, 10).num_microbatches == 10
    assert xp.interleaved_1f1b(4, 3).num_microbatches == 3
    with pytest.raises(ValueError, match="multiple of its 3 rounds"):
        xp.interleaved_1f1b(4, 13)
    with pytest.raises(ValueError, match="num_microbatches >= the 8 stages"):
        xp.dualpipev(4, 7)
    with pytest.raises(ValueError, match="chunks=2"):
        xp.zbv(2, 4, chunks=3)


def test_v_placement_puts_first_and_last_stage_on_rank_0() -> None:
    assert xp.zbv(3, 6).placement == (0, 1, 2, 2, 1, 0)
    assert xp.dualpipev(2, 4).placement == (0, 1, 1, 0)


def test_make_unknown_lists_known() -> None:
    for name in ("pipedream", ["gpipe"], {"gpipe": 1}):  # unhashable: was a bare TypeError
        with pytest.raises(ValueError, match=r"unknown schedule .*; known: .*gpipe"):
            xp.make(name, 2, 2)  # type: ignore[arg-type]


def test_numpy_integers_are_sizes() -> None:
    np = pytest.importorskip("numpy")
    s = xp.make("1f1b", np.int64(4), np.int32(8))
    assert s == xp.make("1f1b", 4, 8) and type(s.num_microbatches) is int


def test_numpy_sizes_are_counted_against_the_size_limit_and_chunks_may_be_numpy() -> None:
    """A numpy size skipped the size check (ints only) and was built until memory ran out;
    a numpy ``chunks`` was refused though the sizes beside it are taken."""
    np = pytest.importorskip("numpy")
    # Just past the limit, so the code before the fix built it in seconds and did not raise.
    with pytest.raises(ValueError, match=r"too large: num_stages=1000, num_microbatches=1001"):
        xp.make("gpipe", np.int64(1000), np.int64(1001))
    with pytest.raises(ValueError, match=r"too large: .*chunks=1000000 make 8,000,000"):
        xp.make("interleaved_1f1b", 2, 4, np.int64(10**6))
    s = xp.make("interleaved_1f1b", 2, 4, np.int32(3))
    assert s == xp.make("interleaved_1f1b", 2, 4, 3) and s.num_stages == 6


@pytest.mark.parametrize("chunks", ["x", 0, 1.5, True])
def test_make_refuses_a_bad_chunks_even_where_it_is_not_used(chunks: object) -> None:
    with pytest.raises(ValueError, match=r"chunks must be a positive int \(stages per rank\)"):
        xp.make("gpipe", 2, 4, chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "pairs"),
    [("1f1b", 2, 10**9, 2, "2,000,000,000"), ("interleaved_1f1b", 2, 4, 10**6, "8,000,000")],
)
def test_make_refuses_a_schedule_too_large_to_build(
    name: str, p: int, m: int, v: int, pairs: str
) -> None:
    """A typo'd size was built action by action until memory ran out."""
    with pytest.raises(ValueError, match=f"schedule too large: num_stages={p}, .* make {pairs}"):
        xp.make(name, p, m, v)
    assert xp.make("1f1b", 2, 4, 10**6).num_microbatches == 4  # chunks unused: not counted


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zb_h2"])
def test_drawings_next_to_the_code_are_what_it_generates(name: str) -> None:
    import inspect

    from xgrad.pipeline import generators

    source = inspect.getsource(generators)
    sim = xp.simulate(xp.make(name, 4, 8))
    for r, spans in enumerate(sim.spans):
        cells = [".."] * int(sim.makespan)
        for s in spans:
            for t in range(int(s.start), int(s.end)):
                cells[t] = f"{s.action.kind.value}{s.action.microbatch}"
        assert f"#   rank {r}  {''.join(cells).rstrip('.')}\n" in source


def test_interleaved_drawing_is_what_it_generates() -> None:
    import inspect

    from xgrad.pipeline import multistage

    source = inspect.getsource(multistage)
    for r, acts in enumerate(xp.interleaved_1f1b(2, 4, chunks=2).actions):
        assert f"#   rank {r}  {' '.join(map(str, acts))}\n" in source
