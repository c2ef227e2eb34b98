"""compat_core must never import ray, mlflow, boto3 or botocore: checked statically and at run time."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import compat_core

FORBIDDEN = ("ray", "mlflow", "boto3", "botocore")
PACKAGE_DIR = Path(compat_core.__file__).resolve().parent


def _imported_top_level_names(tree: ast.AST) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module.split(".")[0]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.args[0] if node.args else None, ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
        ):
            # importlib.import_module("ray") / __import__("mlflow") with a literal name
            names.append((node.lineno, node.args[0].value.split(".")[0]))
    return names


def test_ast_scan_finds_no_forbidden_imports():
    sources = sorted(PACKAGE_DIR.rglob("*.py"))
    assert sources, f"no Python files found under {PACKAGE_DIR}"
    offenders = []
    for source in sources:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
        for line, name in _imported_top_level_names(tree):
            if name in FORBIDDEN:
                offenders.append(f"{source.relative_to(PACKAGE_DIR.parent)}:{line} imports {name}")
    assert not offenders, "compat_core must not import " + ", ".join(FORBIDDEN) + ":\n" + "\n".join(offenders)


def test_ast_scanner_detects_each_import_form():
    # guards the scanner itself: every form below must be reported
    sample = (
        "import ray\nimport mlflow.pytorch as m\nfrom boto3 import client\nfrom botocore.config import Config\n"
        "import importlib\nimportlib.import_module('ray.tune')\n__import__('mlflow')\nfrom . import sibling\n"
    )
    found = [name for _, name in _imported_top_level_names(ast.parse(sample))]
    assert found.count("ray") == 2 and found.count("mlflow") == 2
    assert "boto3" in found and "botocore" in found


def _import_all_in_fresh_interpreter(package: str, watched: tuple[str, ...], search_path: Path) -> dict:
    """Import ``package`` and every submodule in a new interpreter; report which ``watched`` names got loaded."""
    # a fresh interpreter so that modules imported by other tests cannot hide or fake a result
    script = f"""
import importlib, json, pkgutil, sys
package = importlib.import_module({package!r})
errors = {{}}
modules = [{package!r}]
def walk_error(name):
    errors[name] = repr(sys.exc_info()[1])
for info in pkgutil.walk_packages(package.__path__, prefix={package!r} + ".", onerror=walk_error):
    modules.append(info.name)
    try:
        importlib.import_module(info.name)
    except Exception as error:  # report, do not hide: a broken module is its own test failure
        errors[info.name] = repr(error)
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({list(watched)!r}))
print(json.dumps({{"modules": modules, "loaded": loaded, "errors": errors}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=search_path
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_submodule_loads_no_forbidden_module():
    report = _import_all_in_fresh_interpreter("compat_core", FORBIDDEN, PACKAGE_DIR.parent)
    assert "compat_core.evaluation.metrics" in report["modules"] and "compat_core.evaluation.theory" in report["modules"]
    assert report["loaded"] == [], f"importing compat_core loaded {report['loaded']}"
    assert report["errors"] == {}, f"compat_core submodules failed to import: {report['errors']}"


def test_runtime_check_detects_an_indirect_import(tmp_path):
    # guards the run-time check itself, with stdlib modules standing in for the forbidden ones: a nested submodule
    # importing one indirectly (through a helper) must be reported
    package = tmp_path / "purity_probe"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "helper.py").write_text("import colorsys\n")
    (package / "inner" / "user.py").write_text("from . import helper\n")
    report = _import_all_in_fresh_interpreter("purity_probe", ("colorsys", "wave"), tmp_path)
    assert "purity_probe.inner.user" in report["modules"]
    assert report["loaded"] == ["colorsys"]


# ---- layers: compat_core < pipelines < cluster < app (the command line) ----------------------------------------------
LAYER_RULES = {
    "compat_core": ("pipelines", "cluster", "app"),
    "pipelines": ("cluster", "app"),
    "cluster": ("app",),
}


def _layer_offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    root = PACKAGE_DIR.parent
    offenders = []
    for source in sorted((root / package).rglob("*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
        for line, name in _imported_top_level_names(tree):
            if name in forbidden:
                offenders.append(f"{source.relative_to(root)}:{line} imports {name}")
    return offenders


def test_lower_layers_never_import_higher_ones():
    offenders = [found for package, forbidden in LAYER_RULES.items() for found in _layer_offenders(package, forbidden)]
    assert not offenders, "a layer imports one above it:\n" + "\n".join(offenders)


def test_layer_scan_would_catch_pipelines_importing_cluster(tmp_path, monkeypatch):
    # guards the rule itself: a module of pipelines importing cluster is reported
    fake_root = tmp_path / "pipelines"
    fake_root.mkdir()
    (fake_root / "bad.py").write_text("def f():\n    from cluster.tune.runner import run_search\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", tmp_path / "compat_core")
    assert _layer_offenders("pipelines", ("cluster",)) == ["pipelines/bad.py:2 imports cluster"]
