"""MkDocs hooks (`hooks:` in .ci/mkdocs.yml) that make the site's pages at build time, so none is a copy that can drift.

- the front page is README.md and the results page benchmarks/README.md; every repository file they link to (the
  reports and figures of the results, followed link by link through the Markdown files among them) is on the site at
  its path in the repository, so their relative links work there as they do on the repository's web page;
- one API reference page per public module of varsmooth (the package, each subpackage, each top-level module whose
  name has no leading underscore): the module's docstring, then a mkdocstrings `:::` directive for every name of its
  `__all__`. The package's page lists its `__all__` as cross-references to where each name is documented, so a name
  that is not documented there fails the build (`mkdocs build --strict`).

The page list and texts come from `api_pages()`, which needs nothing but the standard library: tests/test_docs.py
reads it to check that every public name has a page entry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "varsmooth"
PACKAGE_NAME = "varsmooth"
#: the repository's pages the site starts from, at their repository paths: README.md is the front page (MkDocs makes
#: a folder's README.md its index), benchmarks/README.md the results page
REPOSITORY_PAGES = ("README.md", "benchmarks/README.md")
#: a relative Markdown link or image target (the part before any #anchor)
_LINK = re.compile(r"\]\(\s*<?([^)\s#>]+)")


def public_modules() -> list[str]:
    """The documented modules, by dotted name: the package, its subpackages, then its top-level modules (no leading
    underscore in the name), each group alphabetical."""
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if not p.parent.name.startswith("_"))
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))
    return [PACKAGE_NAME] + [f"{PACKAGE_NAME}.{name}" for name in subpackages + modules]


def module_file(module: str) -> Path:
    """The source file of a module of the package, by dotted name."""
    parts = module.split(".")[1:]
    package_init = PACKAGE.joinpath(*parts, "__init__.py")
    return package_init if package_init.exists() else PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")


def _tree(module: str) -> ast.Module:
    return ast.parse(module_file(module).read_text(encoding="utf-8"))


def module_all(module: str) -> list[str]:
    """The module's `__all__`, read from its source (nothing is imported); [] when it has none."""
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def package_exports() -> dict[str, str]:
    """Each name of the package's `__all__` -> the public module it is imported from (`from .x import name`), where its
    API reference entry is."""
    sources = {}
    for node in _tree(PACKAGE_NAME).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                sources[alias.asname or alias.name] = f"{PACKAGE_NAME}.{node.module}"
    return {name: sources.get(name, PACKAGE_NAME) for name in module_all(PACKAGE_NAME)}


def api_page_path(module: str) -> str:
    """The site path of a module's API reference page."""
    return f"api/{module}.md"


def api_page(module: str) -> str:
    """The Markdown source of a module's API reference page."""
    # the module's docstring under its full name as the page's title (and cross-reference target), then its names
    lines = [f"::: {module}", "    options:", "      heading_level: 1", "      show_root_full_path: true",
             "      members: false", ""]
    if module == PACKAGE_NAME:
        lines += ["Everything below is importable as `varsmooth.<name>`; each entry links to where it is documented.",
                  ""]
        for name, source in package_exports().items():
            target = f"{source}.{name}" if source != PACKAGE_NAME else f"{PACKAGE_NAME}.{name}"
            lines.append(f"- [`{name}`][{target}] (from [`{source}`][{source}])")
        return "\n".join(lines) + "\n"
    for name in module_all(module):
        lines += [f"::: {module}.{name}", ""]
    return "\n".join(lines)


def api_pages() -> dict[str, str]:
    """Site path -> Markdown source of every API reference page, in the navigation's order."""
    return {api_page_path(module): api_page(module) for module in public_modules()}


def linked_files(start: str) -> list[str]:
    """Repository paths of `start` (a Markdown file) and of every repository file its relative links reach, followed
    through the Markdown files among them."""
    seen, todo = [], [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        if not path.endswith(".md"):
            continue
        for target in _LINK.findall((ROOT / path).read_text(encoding="utf-8")):
            if "://" in target or target.startswith(("/", "mailto:")):
                continue
            resolved = (ROOT / path).parent.joinpath(target).resolve()
            if resolved.is_file() and resolved.is_relative_to(ROOT):  # a link to nothing is left to mkdocs to report
                todo.append(resolved.relative_to(ROOT).as_posix())
    return seen


def on_config(config):
    """The navigation: the front page, the results, one API reference page per public module, how to build the site."""
    config.nav = [
        {"Home": "README.md"},
        {"Results": "benchmarks/README.md"},
        {"API reference": [{module: api_page_path(module)} for module in public_modules()]},
        {"Building these docs": "building.md"},
    ]
    return config


def on_files(files, config):
    """Adds the generated pages to the site's files."""
    from mkdocs.structure.files import File

    def add(src_uri: str, **source) -> None:
        if files.get_file_from_path(src_uri) is not None:
            files.remove(files.get_file_from_path(src_uri))
        files.append(File.generated(config, src_uri, **source))

    for start in REPOSITORY_PAGES:
        for path in linked_files(start):
            add(path, abs_src_path=str(ROOT / path))
    for src_uri, text in api_pages().items():
        add(src_uri, content=text)
    return files
