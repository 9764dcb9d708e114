"""The documentation site (.ci/mkdocs.yml, pages made by .ci/docs/hooks.py): every public name of varsmooth has a
docstring and an entry in the API reference, and the site builds with warnings as errors (a broken cross-reference,
link or docstring fails it)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".ci" / "mkdocs.yml"


def _load_hooks():
    spec = importlib.util.spec_from_file_location("varsmooth_docs_hooks", ROOT / ".ci" / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()
MODULES = hooks.public_modules()


@cache
def _source_tree(module: str) -> ast.Module:
    return ast.parse(hooks.module_file(module).read_text(encoding="utf-8"))


def _resolve(module: str, level: int, name: str | None) -> str:
    """The dotted module a relative `from ... import` inside `module` names."""
    base = module.split(".")
    if not hooks.module_file(module).name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _value_documented(module: str, name: str) -> bool:
    """Whether a module-level value (a constant, a registry) has a docstring: a `#:` comment right above its
    assignment or a string literal right after it, where it is assigned (following `from .x import name`)."""
    path = hooks.module_file(module)
    lines = path.read_text(encoding="utf-8").splitlines()
    body = _source_tree(module).body
    for i, node in enumerate(body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(getattr(target, "id", None) == name for target in targets):
            above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            after = body[i + 1] if i + 1 < len(body) else None
            literal = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str) and after.value.value.strip()
            return above.startswith("#:") and len(above) > 2 or bool(literal)
        if isinstance(node, ast.ImportFrom) and node.level and any((a.asname or a.name) == name for a in node.names):
            return _value_documented(_resolve(module, node.level, node.module), name)
    raise AssertionError(f"{module}.{name} is in __all__ but neither assigned nor imported at module level")


def _own_docstring(obj) -> str:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and (doc or "").startswith(f"{obj.__name__}("):
        return ""  # the signature dataclasses write where the class has no docstring
    return (doc or "").strip()


def test_every_public_module_has_an_all_and_a_page():
    assert MODULES[0] == "varsmooth" and "varsmooth.trainer" in MODULES and "varsmooth.metrics" in MODULES
    pages = hooks.api_pages()
    for module in MODULES:
        assert hooks.module_all(module), f"{module} is public (no leading underscore) but declares no __all__"
        assert hooks.api_page_path(module) in pages


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_docstring(module):
    imported = importlib.import_module(module)
    assert _own_docstring(imported), f"{module} has no module docstring"
    missing = []
    for name in hooks.module_all(module):
        obj = getattr(imported, name)
        if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
            documented = bool(_own_docstring(obj))
        else:
            documented = _value_documented(module, name)
        if not documented:
            missing.append(name)
    assert not missing, (f"public names of {module} without a docstring (a `#:` comment above a constant counts): "
                         f"{missing}")


def test_every_public_name_is_in_the_api_reference():
    pages = hooks.api_pages()
    for module in MODULES:
        source = pages[hooks.api_page_path(module)]
        assert f"::: {module}\n" in source
        if module == hooks.PACKAGE_NAME:
            # the package re-exports: each entry is a cross-reference to the page that documents the name
            for name, home in hooks.package_exports().items():
                assert home in MODULES, f"varsmooth.{name} is imported from {home}, which has no API page"
                assert f"[`{name}`][{home}.{name}]" in source
                assert f"::: {home}.{name}\n" in pages[hooks.api_page_path(home)], \
                    f"varsmooth.{name} links to {home}.{name}, which {home}'s page does not document"
        else:
            directives = {line[4:] for line in source.splitlines() if line.startswith("::: ")}
            missing = [name for name in hooks.module_all(module) if f"{module}.{name}" not in directives]
            assert not missing, f"names of {module}.__all__ without a ::: entry on its API page: {missing}"


def test_the_site_pulls_the_readmes_in_rather_than_copying_them():
    assert hooks.REPOSITORY_PAGES == ("README.md", "benchmarks/README.md")
    assert not list((ROOT / ".ci" / "docs").glob("*README*")) and not (ROOT / ".ci" / "docs" / "index.md").exists()
    linked = hooks.linked_files("README.md")
    assert linked[:2] == ["README.md", "benchmarks/README.md"], "the front page links to the results page"
    assert all((ROOT / path).is_file() for path in linked)


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material", "griffe_sphinx"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"the docs extra is not installed ({module} missing): pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d",
                             str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    for page in ["index.html", "benchmarks/index.html"] + [f"api/{module}/index.html" for module in MODULES]:
        assert (tmp_path / "site" / page).is_file(), page
