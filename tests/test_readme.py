"""The README's examples run as written (each in a fresh interpreter, as a reader would)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
#: blocks that need a launcher; the same code runs in tests/torch_backend (examples/).
LAUNCHED = "# run under torchrun"


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 6
    assert "make demo" in README.read_text().split("\n\n")[1]


@pytest.mark.parametrize(
    "code", [b for b in BLOCKS if not b.startswith(LAUNCHED)], ids=lambda b: b.split("\n")[0]
)
def test_example_runs(code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
