"""The package's layout: no module imports a private name of another, and the modules' imports
of each other form no cycle. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds41numba"

def _modules() -> dict[str, Path]:
    """``{"ds41numba.golden.files": path, ...}`` for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict[str, Path]):
    """``(importer, imported module, name or None)`` for every import of a package module."""
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "ds41numba":
                        yield name, alias.name, None
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "ds41numba":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    yield (name, sub, None) if sub in modules else (name, target, alias.name)


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    bad = sorted(f"{importer} imports {name} from {target}"
                 for importer, target, name in _imports(modules) if _private(name))
    assert not bad, "private names imported across modules: " + "; ".join(bad)


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {m: set() for m in modules}
    for importer, target, _ in _imports(modules):
        if target in modules and target != importer:
            graph[importer].add(target)
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert {"ds41numba.golden.run", "ds41numba.stack", "ds41numba.cli"} <= set(graph)
    assert "ds41numba.stack" in graph["ds41numba.golden.run"]
