"""Progress: plain lines where the stream is not a terminal, nothing without a stream."""

from __future__ import annotations

import io

from xgrad.progress import Progress, progress


def test_lines_without_a_terminal() -> None:
    out = io.StringIO()
    with Progress(3, "run", out) as bar:
        bar.say("first")
        bar.advance("next")
        bar.say("second")
    assert out.getvalue() == "first\nsecond\n"  # no bar drawn into a file or a pipe


def test_no_stream_no_output() -> None:
    with Progress(1, "run", None) as bar:
        bar.say("nothing")
        bar.advance()


def test_progress_yields_every_item() -> None:
    assert list(progress(range(4), "items")) == [0, 1, 2, 3]
