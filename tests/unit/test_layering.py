"""Layering: scheduler is pure standard library; cluster never imports torch; no import cycles in cluster."""

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


# ---- no import cycles ------------------------------------------------------------------------


def _package_modules(package: str, root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(package: str, root: Path = REPO) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: line of the first such import}.

    Every `import` and `from ... import` counts wherever it is: at module level, under
    `if TYPE_CHECKING:`, or inside a function (an import that runs late is still a dependency).
    `import a.b` and `from a import b` name the module a.b when a.b is one, else the package a;
    relative imports are resolved against the importing module's package. The parents that
    Python imports on the way (a.b imports a first) are not edges: a package's __init__ may
    re-export its submodules."""
    modules = _package_modules(package, root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        own_package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split(".")[: len(own_package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
            else:
                continue
            for target in targets:
                resolved = known(target)
                if resolved is not None and resolved != name:
                    edges.setdefault(resolved, node.lineno)
        graph[name] = edges
    return graph


def tangles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively):
    every import cycle lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, {})))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle (modules, the first repeated at the end) per tangle."""
    cycles = []
    for component in tangles(graph):
        start = min(component)
        # Breadth-first within the component, from `start` back to it.
        previous: dict[str, str] = {}
        frontier = [start]
        while start not in previous:
            following = []
            for node in frontier:
                for successor in sorted(graph[node]):
                    if successor in component and successor not in previous:
                        previous[successor] = node
                        following.append(successor)
            frontier = following
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append(path[::-1])
    return cycles


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e2": 1}, "e2": {"e": 1}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_import_graph_resolves_relative_imports(tmp_path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "import os\nfrom .sub.c import name\n",
        "pkg/sub/__init__.py": "from .c import name\n",
        "pkg/sub/c.py": "def late():\n    from ..a import thing\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph = import_graph("pkg", tmp_path)
    assert graph == {
        "pkg": {},
        "pkg.a": {"pkg.b": 1},
        "pkg.b": {"pkg.sub.c": 2},
        "pkg.sub": {"pkg.sub.c": 1},
        "pkg.sub.c": {"pkg.a": 2},
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_the_import_graph_sees_every_kind_of_import() -> None:
    graph = import_graph("cluster")
    assert "cluster.cli.common" in graph["cluster.cli.main"]  # module level
    assert "cluster.deploy.serve" in graph["cluster.cli.serve"]  # inside a function
    assert "cluster.client.sdk" in graph["cluster.client"]  # a package's __init__
    assert "cluster.cli.bench" in graph["cluster.cli.main"]  # from a package import a module


def test_no_import_cycles_in_cluster() -> None:
    graph = import_graph("cluster")
    described = []
    for component, cycle in zip(tangles(graph), find_cycles(graph), strict=True):
        steps = " -> ".join(f"{module} (line {graph[module][following]})" for module, following in zip(cycle, cycle[1:], strict=False))
        described.append(f"{steps} -> {cycle[-1]}; all modules of this tangle: {', '.join(sorted(component))}")
    assert not described, "import cycles:\n" + "\n".join(described)


def test_no_python_package_named_proto() -> None:
    # ray[default] installs proto-plus, which owns the import name 'proto'.
    assert not (REPO / "proto" / "__init__.py").exists()
