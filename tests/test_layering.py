"""The arrows point one way, read from the source (lazy imports and TYPE_CHECKING included).

- the core (``xgrad/`` outside the backends) never imports a framework backend
  (``xgrad.torch_backend``/``xgrad.jax_backend``: it finds them through the registry), nor
  a framework (torch, jax) — except the experiments and the command line, which sit above
  the backends and may import a framework in code that runs in a backend's ranks;
- no backend (``torch_backend``, ``jax_backend``, ``reference``) imports what sits above
  the backends: ``xgrad.crosscheck``, ``xgrad.experiments``, ``xgrad.commands``, ``xgrad.cli``.

The import test of ``test_backend.py`` catches what runs at import time; this one also
sees an import inside a function that runs only on some path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xgrad"

FRAMEWORK_BACKENDS = ("xgrad.torch_backend", "xgrad.jax_backend")
BACKENDS = (*FRAMEWORK_BACKENDS, "xgrad.reference")
FRAMEWORKS = ("torch", "jax", "jaxlib")
ABOVE_BACKENDS = ("xgrad.crosscheck", "xgrad.experiments", "xgrad.commands", "xgrad.cli")
#: may import a framework (never a backend module) in functions run in spawned ranks.
FRAMEWORK_USERS = ("xgrad.experiments", "xgrad.commands", "xgrad.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere in its body, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from x import mod`
    return found


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def wrong_arrows() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        for target in sorted(imports(path)):
            core = not _under(name, BACKENDS)
            if core and _under(target, FRAMEWORK_BACKENDS):
                wrong.append(f"core {name} imports {target}")
            if core and not _under(name, FRAMEWORK_USERS) and _under(target, FRAMEWORKS):
                wrong.append(f"core {name} imports {target}")
            if _under(name, BACKENDS) and _under(target, ABOVE_BACKENDS):
                wrong.append(f"backend {name} imports {target}")
    return wrong


def test_arrows_point_down() -> None:
    assert wrong_arrows() == []


def test_the_reader_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The check can fail: a lazy import inside a function is found, relative ones resolved."""
    fake = PACKAGE / "crosscheck" / "_probe_for_test.py"
    assert not fake.exists()
    fake.write_text(
        "def f():\n    from xgrad.torch_backend import spawn\n    import jax.numpy\n"
        "from ..reference import comm\n"
    )
    try:
        assert imports(fake) >= {"xgrad.torch_backend", "jax.numpy", "xgrad.reference.comm"}
        found = wrong_arrows()
    finally:
        fake.unlink()
    assert "core xgrad.crosscheck._probe_for_test imports xgrad.torch_backend" in found
    assert "core xgrad.crosscheck._probe_for_test imports jax.numpy" in found


def test_the_core_names_no_backend_module_in_code() -> None:
    """No core module reaches a framework backend by its dotted path either (the registry in
    ``backend.py`` is the one place that knows where the built-in backends live)."""
    import re

    path_of_backend = re.compile(r"^xgrad\.(torch|jax)_backend(\.\w+)*(:\w+)?$")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if _under(name, BACKENDS) or name == "xgrad.backend":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if is_text and path_of_backend.match(node.value):
                found.append(f"{name}: {node.value!r}")
    assert found == []
