"""A PNG of a simulated timeline (needs matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import os

from xgrad.pipeline.actions import Kind
from xgrad.pipeline.simulate import Simulation

__all__ = ["save_timeline_png"]

_COLOURS = {
    Kind.FORWARD: "#4c72b0",
    Kind.BACKWARD: "#dd8452",
    Kind.BACKWARD_INPUT: "#c44e52",
    Kind.BACKWARD_WEIGHT: "#55a868",
}


_NAMES = {
    Kind.FORWARD: "F forward",
    Kind.BACKWARD: "B backward (input and weights)",
    Kind.BACKWARD_INPUT: "I backward, input gradient",
    Kind.BACKWARD_WEIGHT: "W backward, weight gradient",
}


def _shade(colour: str, chunk: int, chunks: int) -> str:
    """The kind's colour, lighter for each later chunk of a rank (chunk 0 full strength)."""
    if chunks <= 1 or chunk == 0:
        return colour
    mix = 0.45 * chunk / (chunks - 1)
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def save_timeline_png(
    sim: Simulation, path: str | os.PathLike[str], title: str = "", *, name: str = ""
) -> None:
    """Draw one row per rank, one box per action.

    Each box reads ``stage kind microbatch`` (``2F0``: chunk stage 2, forward, microbatch 0)
    and is coloured by kind (F, B, I, W), lighter for a rank's later chunks; the legend
    names the kinds and the chunks; the title gives the schedule's ``name`` and its bubble
    fraction.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'xgrad[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise RuntimeError(
            f"writing a PNG timeline needs matplotlib, which is not installed ({exc}); "
            "install it with: pip install 'xgrad[plot]'"
        ) from None
    p = len(sim.spans)
    chunks_of = [sorted({s.action.stage for s in spans}) for spans in sim.spans]
    chunks = max((len(c) for c in chunks_of), default=1)
    width = max(6.0, sim.makespan * (0.32 if chunks > 1 else 0.25))
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 2.0))
    kinds: set[Kind] = set()
    for r, spans in enumerate(sim.spans):
        for s in spans:
            kinds.add(s.action.kind)
            chunk = chunks_of[r].index(s.action.stage)
            ax.broken_barh(
                [(s.start, s.end - s.start)],
                (p - 1 - r - 0.4, 0.8),
                facecolors=_shade(_COLOURS[s.action.kind], chunk, chunks),
                edgecolors="white",
            )
            ax.text(
                (s.start + s.end) / 2,
                p - 1 - r,
                str(s.action),
                ha="center",
                va="center",
                fontsize=6 if chunks > 1 else 7,
                color="black" if chunk else "white",
            )
    ax.set_yticks(range(p), [f"rank {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("time")
    handles = [Patch(facecolor=_COLOURS[k], label=_NAMES[k]) for k in _COLOURS if k in kinds]
    if chunks > 1:
        handles += [
            Patch(facecolor=_shade("#808080", c, chunks), label=f"chunk {c} of a rank")
            for c in range(chunks)
        ]
        handles.append(Patch(facecolor="white", label="label: stage, kind, microbatch"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=7)
    heading = title or f"{name}: bubble fraction {sim.bubble_fraction:.3f} of total time"
    ax.set_title(heading)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
