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


def _fake_backend(name: str, runner_names: list[str], **extra: object) -> object:
    from types import SimpleNamespace

    from xgrad.backend import unsupported_by_declaration

    class R:
        hooks = ("allreduce",)
        dtypes = ("float32",)

        def __init__(self, n: str) -> None:
            self.name, self.description = n, f"runner {n}"

        def unsupported(self, step: object) -> str | None:
            return unsupported_by_declaration(self, step)  # type: ignore[arg-type]

    return SimpleNamespace(
        name=name, available=lambda: True, runners=lambda: [R(n) for n in runner_names], **extra
    )


@pytest.mark.usefixtures("clean_registry")
def test_runner_entries_pick_backends_or_runners_and_leave_opt_in_ones_out() -> None:
    from xgrad.backend import runner_entries

    register_backend("two", _fake_backend("two", ["two-a", "two-b"]))  # type: ignore[arg-type]
    register_backend("extra", _fake_backend("extra", ["extra"], BY_DEFAULT=False))  # type: ignore[arg-type]
    default = [e.name for e in runner_entries(check=False)]
    assert "two-a" in default and "two-b" in default and "extra" not in default
    assert "extra" in [e.name for e in runner_entries(check=False, every=True)]
    assert [e.name for e in runner_entries(["two"], check=False)] == ["two-a", "two-b"]
    assert [e.name for e in runner_entries(["two-b", "extra"], check=False)] == ["two-b", "extra"]
    with pytest.raises(
        ValueError, match=r"unknown backends \['nope'\]; known backends and runners"
    ):
        runner_entries(["nope"], check=False)
    with pytest.raises(ValueError, match="no backend named"):
        runner_entries([], check=False)


@pytest.mark.usefixtures("clean_registry")
def test_a_plug_in_that_fails_to_import_is_an_entry_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xgrad.backend import runner_entries

    (tmp_path / "raising_backend_mod.py").write_text("raise RuntimeError('no licence')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("raising", "raising_backend_mod")
    (entry,) = runner_entries(["raising"])
    assert entry.runner is None and "RuntimeError: no licence" in entry.unavailable
    assert backend_available("raising") == (False, "cannot import: RuntimeError: no licence")


def test_declared_hooks_and_dtypes_say_why_not() -> None:
    from xgrad.step import make_step

    runner = _fake_backend("x", ["x"]).runners()[0]  # type: ignore[attr-defined]
    assert runner.unsupported(make_step()) is None
    assert runner.unsupported(make_step(hook="fp16")) == "x runs hooks allreduce only, not 'fp16'"
    assert runner.unsupported(make_step(dtype="float64")) == "x runs float32 only, not float64"


@pytest.mark.usefixtures("clean_registry")
def test_bench_targets_and_the_truth_come_from_the_registry() -> None:
    from xgrad.backend import Truth, backend_benches, find_truth

    assert backend_benches()["ddp"] == "xgrad.torch_backend.bench"  # the torch backend's
    register_backend("dup", _fake_backend("dup", ["dup"], BENCHES={"ddp": "elsewhere"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bench target 'ddp' is claimed twice"):
        backend_benches()
    truth = find_truth("mlp")
    assert truth.independent  # torch's autograd, preferred over xgrad's own engine
    own = Truth(lambda *a: {}, lambda m: m == "only-here", "own", independent=False)
    register_backend("t", _fake_backend("t", ["t"], truth=lambda: own))  # type: ignore[arg-type]
    assert find_truth("only-here") is own
    with pytest.raises(RuntimeError, match="no float64 truth for model 'nowhere'"):
        find_truth("nowhere")
