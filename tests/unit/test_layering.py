"""DESIGN.md §1 layering: scheduler is pure standard library; cluster never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_scheduler_imports_only_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"scheduler", "__future__"}
    offenders = {}
    for path in sorted((REPO / "scheduler").rglob("*.py")):
        bad = _imported_top_levels(path) - allowed
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, offenders


def _modules(package: str) -> list[str]:
    root = REPO / package
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def _torch_free(modules: list[str]) -> None:
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        sys.exit('importing ' + name + ' imported torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def test_importing_any_cluster_module_does_not_import_torch() -> None:
    modules = _modules("cluster")
    assert "cluster.cli.main" in modules
    _torch_free(modules)


def test_torch_free_worker_modules_stay_torch_free() -> None:
    # The front end validates requests and the router moves KV metadata with these.
    candidates = ["worker", "worker.kv_layout", "worker.sampling", "worker.protocol", "worker.handover"]
    candidates += [m for m in _modules("worker") if m.startswith("worker.kv_transfer")]
    _torch_free([m for m in candidates if (REPO / (m.replace(".", "/") + ".py")).exists() or (REPO / m.replace(".", "/")).is_dir()])


def test_no_python_package_named_proto() -> None:
    # ray[default] installs proto-plus, which owns the import name 'proto'.
    assert not (REPO / "proto" / "__init__.py").exists()
