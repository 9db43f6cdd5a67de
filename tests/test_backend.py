"""The backend registry: lazy import, refused duplicates, entry points, helpful errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xgrad import backend
from xgrad.backend import (
    backend_available,
    get_backend,
    list_backends,
    register_backend,
)


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_REGISTRY", dict(backend._REGISTRY))


def test_builtin_backends_are_listed() -> None:
    assert {"reference", "torch", "jax"} <= set(list_backends())


def test_unknown_backend_lists_known_names() -> None:
    with pytest.raises(KeyError) as err:
        get_backend("nccl-on-the-moon")
    message = err.value.args[0]
    assert "'nccl-on-the-moon'" in message
    assert "reference" in message and "torch" in message


@pytest.mark.usefixtures("clean_registry")
def test_registration_is_lazy_and_duplicates_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lazy_backend_mod.py").write_text(
        "IMPORTED = True\ndef available():\n    return True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("lazy", "lazy_backend_mod")
    assert "lazy_backend_mod" not in sys.modules  # nothing imported at registration
    module = get_backend("lazy")
    assert module.IMPORTED
    assert backend_available("lazy") == (True, "")
    with pytest.raises(ValueError, match="'lazy' is already registered"):
        register_backend("lazy", "lazy_backend_mod")
    with pytest.raises(ValueError, match="non-empty string"):
        register_backend("", "x")


@pytest.mark.usefixtures("clean_registry")
def test_entry_point_backend_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package outside the repository adds a backend through the entry-point group."""
    (tmp_path / "outside_backend.py").write_text("def available():\n    return False\n")
    info = tmp_path / "outside_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[xgrad.backends]\noutside = outside_backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "outside" in list_backends()
    assert get_backend("outside").__name__ == "outside_backend"
    assert backend_available("outside") == (False, "its available() says no")


@pytest.mark.usefixtures("clean_registry")
def test_unimportable_backend_is_reported_not_raised() -> None:
    register_backend("broken", "module_that_does_not_exist_anywhere")
    ok, why = backend_available("broken")
    assert not ok and "module_that_does_not_exist_anywhere" in why


def test_the_core_imports_neither_torch_nor_jax() -> None:
    """Every module outside the backends imports in a fresh interpreter without either."""
    import subprocess

    code = (
        "import pkgutil, sys, xgrad\n"
        "for m in pkgutil.walk_packages(xgrad.__path__, 'xgrad.'):\n"
        "    if not m.name.startswith(('xgrad.torch_backend', 'xgrad.jax_backend')):\n"
        "        __import__(m.name)\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'jax'))\n"
        "print(len([n for n in sys.modules if n.startswith('xgrad.')]), loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert int(done.stdout.split()[0]) > 30  # the walk really imported the core


def test_lazy_attributes_import_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from xgrad.backend import lazy_attributes\n"
        "__getattr__ = lazy_attributes(__name__, {'VALUE': 'lazy_pkg.heavy'})\n"
    )
    (pkg / "heavy.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_pkg", raising=False)
    import lazy_pkg  # type: ignore[import-not-found]

    assert "lazy_pkg.heavy" not in sys.modules
    assert lazy_pkg.VALUE == 42
    assert "lazy_pkg.heavy" in sys.modules and "VALUE" in vars(lazy_pkg)  # cached
    with pytest.raises(AttributeError, match="module 'lazy_pkg' has no attribute 'nope'"):
        _ = lazy_pkg.nope
    for name in ("lazy_pkg", "lazy_pkg.heavy"):
        monkeypatch.delitem(sys.modules, name)
