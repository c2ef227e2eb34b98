"""The import graph of every product package has no cycle, and no function imports a project module.

Walked statically (ast) over the source files, module-level and function-level imports alike, as Ray's
circular-import test does: a cycle hidden behind imports placed inside functions is still a cycle. Function-level
imports are left for optional heavy dependencies only (never project modules), so every dependency between project
modules is visible at the top of the file that has it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compat_core", "pipelines", "cluster", "app")
# Optional heavy dependencies a function may import where its layer allows them (none is a project module, so the
# check below never flags them; listed so that the rule is explicit).
OPTIONAL_HEAVY = ("ray", "mlflow", "boto3", "botocore", "timm", "faiss", "matplotlib")
PARAMS = list(PACKAGES)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file of every module of the product packages (``pkg/__init__.py`` -> ``pkg``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that ``name`` (a module or a name inside one) lives in, or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """Every import statement of a module and whether it sits inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(module -> project modules it imports, module -> ``line: statement`` of its function-level project imports)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    inner: dict[str, list[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, in_function in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: up (level - 1) packages from this module's package
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            hit = {_project_module(target, modules) for target in targets} - {None, name}
            graph[name] |= hit
            if in_function and hit:
                inner.setdefault(name, []).append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return graph, inner


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete cycle through the component's first module: ``[a, b, ..., a]`` (shortest, by breadth-first)."""
    members = set(component)
    start = component[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component + [component[0]]


@pytest.fixture(scope="module")
def graph_of_tree():
    return import_graph(ROOT)


@pytest.mark.parametrize("package", PARAMS)
def test_package_has_no_import_cycle(graph_of_tree, package):
    graph, _ = graph_of_tree
    cycles = [component for component in strongly_connected(graph)
              if any(module.split(".")[0] == package for module in component)]
    described = [f"cycle of {len(c)} modules: {' -> '.join(one_cycle(graph, c))}" for c in cycles]
    assert not cycles, f"import cycles involving {package}:\n  " + "\n  ".join(described)


@pytest.mark.parametrize("package", PARAMS)
def test_package_has_no_function_level_import_of_a_project_module(graph_of_tree, package):
    _, inner = graph_of_tree
    found = [line for module, lines in sorted(inner.items()) if module.split(".")[0] == package for line in lines]
    assert not found, (f"{len(found)} function-level imports of project modules in {package} (imports go at the top; "
                       f"only optional heavy dependencies such as {', '.join(OPTIONAL_HEAVY)} may stay in functions):"
                       "\n  " + "\n  ".join(found))


def test_walker_finds_a_cycle_hidden_in_a_function_and_names_it(tmp_path):
    """The checker itself: a two-module cycle whose back edge is a function-level import is found and named."""
    package = tmp_path / "pipelines"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def late():\n    from pipelines.high import thing\n    return thing\n")
    (package / "high.py").write_text("from pipelines import low\n\nthing = low\n")
    (package / "alone.py").write_text("from . import low\n")
    graph, inner = import_graph(tmp_path)
    assert graph["pipelines.high"] == {"pipelines", "pipelines.low"}
    assert graph["pipelines.alone"] == {"pipelines", "pipelines.low"}
    assert strongly_connected(graph) == [["pipelines.high", "pipelines.low"]]
    assert one_cycle(graph, ["pipelines.high", "pipelines.low"]) == ["pipelines.high", "pipelines.low",
                                                                     "pipelines.high"]
    assert inner == {"pipelines.low": ["pipelines/low.py:2: from pipelines.high import thing"]}
