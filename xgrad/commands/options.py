"""Option types shared by the subcommands: byte sizes with units, counts, output files.

Each is an argparse ``type=``: bad input becomes argparse's one-line error naming the
option (``xgrad plan: error: argument --bucket-cap: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

from xgrad.buckets import MAX_BUCKET_BYTES
from xgrad.tables import STDOUT as STDOUT
from xgrad.tables import add_table_outputs as add_table_outputs
from xgrad.tables import output_file as output_file

#: unit suffix -> bytes. K, M and G are binary, as DDP's ``bucket_cap_mb`` is (MiB).
UNITS: dict[str, int] = {
    "B": 1,
    "K": 2**10,
    "KB": 2**10,
    "KIB": 2**10,
    "M": 2**20,
    "MB": 2**20,
    "MIB": 2**20,
    "G": 2**30,
    "GB": 2**30,
    "GIB": 2**30,
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, *, bare: str = "MB") -> int:
    """``"25MB"``, ``"2048B"``, ``"0.5"`` (in the ``bare`` unit) as a number of bytes > 0.

    Raises:
        ValueError: not a number with a known unit, or not > 0.
    """
    if text.strip().startswith("-"):  # a negative number: a size, but not one > 0
        raise ValueError(f"{text!r}: a size must be > 0 bytes")
    match = _SIZE.match(text)
    unit = (match.group(2) if match else "").upper() or bare.upper()
    if match is None or unit not in UNITS:
        raise ValueError(
            f"{text!r} is not a size: a number and a unit ({', '.join(sorted(UNITS))}), "
            f"e.g. 25MB or 2048B; a bare number is in {bare}"
        )
    value = float(match.group(1)) * UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r}: a size must be > 0 bytes")
    if value > MAX_BUCKET_BYTES:  # PyTorch's DDP takes the cap as an int64 (a crash past it)
        raise ValueError(f"{text!r}: a size must be at most 2**63 - 1 bytes")
    return max(1, int(value))  # a tiny size means one parameter per bucket, not zero bytes


def size(bare: str = "MB") -> Callable[[str], int]:
    """argparse type: :func:`parse_size` with bare numbers in ``bare``."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, bare=bare)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = "size"
    return parse


def _int_at_least(text: str, low: int) -> int:
    """An integer parsed from ``text``, refused below ``low`` (argparse's error type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is not >= {low}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a seed)."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, costs)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def output_folder(text: str) -> Path:
    """argparse type: a folder to write into; it is created if its parent exists."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    if not path.exists() and not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
    return path
