"""The package's import graph, built from the code's own imports (`TYPE_CHECKING` ones and imports inside functions
included): values flow down from the trainer, so nothing below it imports it; there is no import circle between
modules, nor between packages (`varsmooth.trainer`, `varsmooth.posterior`, ... taken whole); and the posterior knows
nothing of `transformers`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "varsmooth"

#: the modules that sit above the trainer: the package's front door, and the scoring of a trained trainer's predictions
ABOVE_THE_TRAINER = {"varsmooth", "varsmooth.evaluation"}
TRAINER, POSTERIOR = "varsmooth.trainer", "varsmooth.posterior"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE, external: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. `from pkg import name` counts as an import of `pkg.name` when that
    is a module, else of `pkg` (its `__init__`). `external`, when given, gets module -> the top-level names of the
    other packages it imports."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
                if external is not None:
                    external.setdefault(name, set()).update(alias.name.split(".")[0] for alias in node.names
                                                            if alias.name.split(".")[0] != package.name)
            elif isinstance(node, ast.ImportFrom):
                if external is not None and not node.level and (node.module or "").split(".")[0] != package.name:
                    external.setdefault(name, set()).add((node.module or "").split(".")[0])
                origin = (".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                for alias in node.names:
                    target = f"{origin}.{alias.name}"
                    if target in modules or origin in modules:
                        targets.add(target if target in modules else origin)
        graph[name] = targets - {name}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's first-level parts: `varsmooth.trainer.checks` counts as `varsmooth.trainer`,
    a top-level module (`varsmooth.outputs`) as itself; the package's front door (`varsmooth`) stays apart."""
    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    collapsed: dict[str, set[str]] = {}
    for name, targets in graph.items():
        collapsed.setdefault(part(name), set()).update(part(t) for t in targets)
    return {name: targets - {name} for name, targets in collapsed.items()}


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """The modules `start` imports, directly or through others, and `start` itself."""
    seen, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), i.e. the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_finds_a_planted_circle_and_an_import_of_the_trainer(tmp_path):
    package = tmp_path / "varsmooth"
    (package / "posterior").mkdir(parents=True)
    (package / "__init__.py").write_text("from .trainer import VariationalTrainer\n")
    (package / "trainer.py").write_text("from .posterior import gaussian\n")
    (package / "posterior" / "__init__.py").write_text("")
    (package / "posterior" / "gaussian.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..trainer import VariationalTrainer\n")
    (package / "posterior" / "helpers.py").write_text("import transformers.utils\n")
    (package / "batchnorm.py").write_text("from .posterior import helpers\n")
    (package / "posterior" / "draws.py").write_text("from ..batchnorm import x\n")
    external: dict[str, set[str]] = {}
    graph = import_graph(package, external)
    assert graph["varsmooth.posterior.gaussian"] == {"varsmooth.trainer"}
    assert cycles(graph) == [frozenset({"varsmooth.trainer", "varsmooth.posterior.gaussian"})]
    assert external["varsmooth.posterior.helpers"] == {"transformers"}
    # posterior.draws -> batchnorm -> posterior.helpers: no circle between modules, one between packages
    assert any({"varsmooth.posterior", "varsmooth.batchnorm"} <= circle for circle in cycles(package_graph(graph)))


def test_nothing_below_the_trainer_imports_it():
    graph = import_graph()
    assert len(graph) > 50  # the whole package was read
    assert f"{TRAINER}.trainer" in graph  # the trainer is a package
    inside = {name for name in graph if name == TRAINER or name.startswith(TRAINER + ".")}
    importers = {name for name, targets in graph.items() if name not in inside and targets & inside}
    assert importers == ABOVE_THE_TRAINER, \
        f"modules below the trainer import it: {sorted(importers - ABOVE_THE_TRAINER)}"


def test_no_import_circle_between_modules_or_packages():
    graph = import_graph()
    found = cycles(graph) + cycles(package_graph(graph))
    assert not found, f"import circles: {[sorted(c) for c in found]}"


def test_the_posterior_knows_nothing_of_transformers():
    """`varsmooth.posterior` (IVON's engine and the Gaussian) is usable without `transformers`: neither its modules nor
    any module of the package they import, directly or through others, imports it."""
    external: dict[str, set[str]] = {}
    graph = import_graph(external=external)
    posterior = {name for name in graph if name == POSTERIOR or name.startswith(POSTERIOR + ".")}
    assert len(posterior) > 5
    users = sorted(name for name in reachable(graph, posterior) if "transformers" in external.get(name, ()))
    assert not users, f"modules the posterior depends on that import transformers: {users}"


#: the classes that are a kind of prediction: asking whether a model or predictor is one of them chooses a kind
PREDICTION_KINDS = re.compile(r"isinstance\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*?\b(DeepEnsemble|\w*Predictor)\b")


def test_only_the_predictors_module_asks_which_kind_a_prediction_is():
    """`varsmooth.prediction.predictors` chooses the kind of every prediction (`make_predictor`); elsewhere a
    prediction is made, described and measured through the `Predictor` interface, never by testing for a kind."""
    asking = {_module_name(path, PACKAGE) for path in PACKAGE.rglob("*.py")
              if PREDICTION_KINDS.search(path.read_text(encoding="utf-8"))}
    assert asking <= {"varsmooth.prediction.predictors"}, f"modules testing for a kind of prediction: {sorted(asking)}"
    assert PREDICTION_KINDS.search("if isinstance(self.accelerator.unwrap_model(model), DeepEnsemble):")
