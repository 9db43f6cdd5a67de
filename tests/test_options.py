"""The command line's option types: sizes with units, counts, output paths."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from xgrad.commands.options import (
    output_file,
    output_folder,
    parse_size,
    positive_float,
    positive_int,
    size,
)


@pytest.mark.parametrize(
    ("text", "bare", "expected"),
    [
        ("25MB", "MB", 25 * 2**20),
        ("2048B", "MB", 2048),
        ("2048", "B", 2048),
        ("0.5", "MB", 2**19),
        ("1.5 kib", "MB", 1536),
        ("1e-9", "MB", 1),  # a tiny cap is one parameter per bucket, never zero bytes
        ("2G", "B", 2**31),
    ],
)
def test_sizes(text: str, bare: str, expected: int) -> None:
    assert parse_size(text, bare=bare) == expected


@pytest.mark.parametrize("text", ["", "MB", "25XB", "-1MB", "0", "1e999MB", "nan"])
def test_bad_sizes_say_what_a_size_is(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        size()(text)


def test_counts_and_seconds() -> None:
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    for bad in ("0", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)


def test_output_paths(tmp_path: Path) -> None:
    assert output_file(str(tmp_path / "a.json")) == tmp_path / "a.json"
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        output_file(str(tmp_path / "missing" / "a.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        output_file(str(tmp_path))
    assert output_folder(str(tmp_path / "new")) == tmp_path / "new"
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        output_folder(str(tmp_path / "missing" / "new"))
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file"):
        output_folder(str(tmp_path / "f"))


@pytest.mark.parametrize("text", ["-5", "-1MB", " -0.5KB"])
def test_a_negative_size_is_named_as_not_above_zero(text: str) -> None:
    """It was "is not a size: a number and a unit", as if the unit were the trouble."""
    with pytest.raises(ValueError, match="a size must be > 0 bytes"):
        parse_size(text)
