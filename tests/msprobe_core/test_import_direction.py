"""Import direction in the core, read from the source with ``ast`` (every import statement, also those
inside functions): no cycles between the core's packages nor between any two of its files, each package
imports only its own layer or the layers below it, the core never imports an integration, integrations
never import each other, and nothing outside ``tests/`` imports from it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "msprobe_core"

LAYERS = (
    ("__init__", "errors", "log", "common"),  # shared utilities
    ("stats", "files", "hparams"),  # the statistics kernel; tensor, record and hyperparameter files
    ("dumpdir",),  # reading dump folders, for every analysis tool
    ("dump",),  # the dump, framework-free: config, selection, API lists, the debugger every framework subclasses
    ("pytorch", "mindspore"),  # per framework: hooks, tensor statistics, tensor files, its dump service
    ("monitor",),  # the training monitor, on PyTorch's hooks and statistics
    ("session",),  # the integration API
    ("cli", "__main__"),  # the command line (imports each command's module when it runs)
)
"""Bottom to top. A package not listed is an analysis feature: above ``monitor``, below ``session``."""

FACADES = {("pytorch", "monitor"), ("pytorch", "config_check")}
"""msprobe-compatible facades: ``msprobe_core.pytorch.TrainerMon`` is the monitor's and
``msprobe_core.pytorch.random_save`` is config_check's, imported on first use."""


def _layer(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    return len(LAYERS) - 2.5  # an analysis feature


def _resolve(path: Path, node: ast.ImportFrom) -> list[str]:
    if node.level:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        base = parts[: len(parts) - node.level]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = []
    for alias in node.names:  # ``from msprobe_core import hparams`` imports msprobe_core.hparams
        sub = ROOT.joinpath(*f"{module}.{alias.name}".split("."))
        out.append(f"{module}.{alias.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else module)
    return out


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at import time?)`` for every import statement of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    eager = set()
    for node in tree.body:  # module level, including under ``try`` / ``if``
        eager.update(id(n) for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in eager) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(module, id(node) in eager) for module in _resolve(path, node)]
    return out


def _package(path_or_module) -> str:
    """``msprobe_core/dump/config.py`` or ``msprobe_core.dump.config`` -> ``dump``; ``msprobe_core.errors`` ->
    ``errors``; ``msprobe_core`` -> ``__init__``."""
    parts = (path_or_module.relative_to(ROOT).with_suffix("").parts if isinstance(path_or_module, Path)
             else path_or_module.split("."))
    return parts[1] if len(parts) > 1 else "__init__"


def _core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it (facades' lazy imports left out)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _core_files():
        here = _package(path)
        for module, eager in _imports(path):
            if module.split(".")[0] == "msprobe_core":
                there = _package(module)
                if there != here and not ((here, there) in FACADES and path.name == "__init__.py" and not eager):
                    graph[here][there].append(path.relative_to(ROOT).as_posix())
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One cycle of packages, each edge with a file that makes it; [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                return [f"{a} -> {b} ({graph[a][b][0]})" for a, b in zip(loop, loop[1:])]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in list(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycles_between_core_packages():
    assert _cycle(_graph()) == []


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _file_cycles() -> list[list[str]]:
    """Every group of core files that import each other in a circle (also through imports inside
    functions), as the sorted paths of each group (Tarjan's strongly connected components)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _core_files():
        for module, _ in _imports(path):
            target = _module_file(module) if module.split(".")[0] == "msprobe_core" else None
            if target is not None and target != path:
                graph[path.relative_to(ROOT).as_posix()].add(target.relative_to(ROOT).as_posix())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_no_import_cycles_between_core_files():
    assert _file_cycles() == []


def test_no_private_name_is_imported_from_another_package():
    """A package uses another one through its public names only (``_read_json`` was once borrowed so)."""
    borrowed = []
    for path in [*_core_files(), *(ROOT / "msprobe_integrations").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("msprobe_core"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                home = path.relative_to(ROOT).parts[:2]
                if private and tuple(node.module.split(".")[:2]) != home:
                    borrowed.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert borrowed == []


def test_each_package_imports_only_its_layer_or_below():
    upward = {f"{a} -> {b}": sorted(set(files)) for a, deps in _graph().items() for b, files in deps.items()
              if _layer(b) > _layer(a)}
    assert upward == {}


def test_framework_folders_hold_framework_code_only():
    """A framework folder imports no feature built on it (the monitor, the analysis tools, the session)."""
    frameworks = _layer("pytorch")
    for framework in LAYERS[frameworks]:
        deps = _graph().get(framework, {})
        assert all(_layer(pkg) <= frameworks for pkg in deps), (framework, dict(deps))


def test_the_pytorch_facade_imports_the_monitor_only_on_first_use():
    for module, eager in _imports(CORE / "pytorch" / "__init__.py"):
        assert not (eager and module.startswith("msprobe_core.monitor")), module


def test_the_core_never_imports_an_integration_tests_or_recipes():
    for path in _core_files():
        for module, _ in _imports(path):
            assert module.split(".")[0] not in ("msprobe_integrations", "tests", "recipes"), (path, module)


INTEGRATION_DOORS = ("msprobe_core.session", "msprobe_core.common.patch", "msprobe_core.errors", "msprobe_core.log",
                     "msprobe_core.hparams")
"""The only modules of the core an integration imports: the session (with the building blocks it documents),
the patch primitive, the exception types, logging and the hyperparameter document."""


def test_integrations_enter_the_core_only_through_the_session():
    past = []
    for path in sorted((ROOT / "msprobe_integrations").rglob("*.py")):
        for module, _ in _imports(path):
            if module.split(".")[0] == "msprobe_core" and module not in INTEGRATION_DOORS:
                past.append(f"{path.relative_to(ROOT).as_posix()}: {module}")
    assert past == []


def test_the_session_documents_every_name_it_exports():
    import msprobe_core.session as session

    undocumented = [name for name in session.__all__ if f"``{name}" not in session.__doc__]
    assert undocumented == []


def test_integrations_do_not_import_each_other():
    integrations = ROOT / "msprobe_integrations"
    for path in integrations.rglob("*.py"):
        own = path.relative_to(integrations).parts[0].removesuffix(".py")
        for module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] == "msprobe_integrations" and len(parts) > 1:
                assert parts[1] == own, (path, module)


def test_nothing_outside_tests_imports_from_tests():
    for folder in ("msprobe_core", "msprobe_integrations", "recipes", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for module, _ in _imports(path):
                assert module.split(".")[0] != "tests", (path, module)
            text = path.read_text(encoding="utf-8")
            assert '"tests"' not in text and "'tests'" not in text, f"{path} puts tests/ on sys.path"
