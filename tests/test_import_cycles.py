"""No import cycles among the library's modules, deferred imports included.

An import inside a function, under `if TYPE_CHECKING:`, or at the bottom of a module ties two modules
together as much as one at the top: which of them imports first decides whether the other finds its names
yet, and the layering stops reading one way. So every import statement anywhere in a module counts.

What is read: every module of the three packages pyproject.toml installs, `float8` <- float8/, `float8.ops`
<- ops/ and `float8.kernels` <- kernels/, parsed with `ast` (nothing is imported). An edge goes from a module
to each library module it names: `import a.b`, `from a import b` where `a.b` is a module (else `a` itself),
and relative imports resolved against the importing module's package. The parent packages Python runs
first (`float8/__init__.py` for `import float8.tensor`) are not edges: every module would then sit in a
cycle with its package's `__init__`.

One case per package: it fails on each cycle that holds one of the package's modules, naming the modules
and the import lines that close it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"float8": ROOT / "float8", "float8.ops": ROOT / "ops", "float8.kernels": ROOT / "kernels"}


def library_modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the three packages (a package's own name for its __init__)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _innermost(name: str, modules) -> str | None:
    """The library module that `name` (a dotted path, maybe into a module's attributes) lies in, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_in(source: str, module: str, is_package: bool, modules) -> dict[str, int]:
    """The library modules `module`'s source imports, anywhere in it, each with the line of its first import."""
    found: dict[str, int] = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_innermost(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - (node.level - 1)])
                source_module = f"{base}.{node.module}" if node.module else base
            else:
                source_module = node.module
            for alias in node.names:
                submodule = f"{source_module}.{alias.name}"
                targets.append(submodule if submodule in modules else _innermost(source_module, modules))
        for target in targets:
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported library module: line}."""
    modules = library_modules()
    return {
        name: imports_in(path.read_text(), name, path.stem == "__init__", modules) for name, path in modules.items()
    }


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that reach one another through imports (each sorted; groups of two or more)."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        reach[start] = seen
    groups = {tuple(sorted({m} | {n for n in reach[m] if m in reach.get(n, ())})) for m in graph}
    return sorted(list(g) for g in groups if len(g) > 1)


def package_of(module: str) -> str:
    return max((p for p in PACKAGES if module == p or module.startswith(p + ".")), key=len)


def describe(cycle: list[str], graph, modules) -> str:
    lines = [f"cycle of {len(cycle)}: {', '.join(cycle)}"]
    for a in cycle:
        for b, line in sorted(graph[a].items()):
            if b in cycle:
                lines.append(f"    {a} -> {b}  ({modules[a].relative_to(ROOT)}:{line})")
    return "\n".join(lines)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_cycle(package):
    graph, modules = import_graph(), library_modules()
    found = [c for c in cycles(graph) if any(package_of(m) == package for m in c)]
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph, modules) for c in found)


def test_the_check_sees_deferred_relative_and_module_imports():
    modules = {"pkg": None, "pkg.a": None, "pkg.b": None, "pkg.c": None, "pkg.sub": None}
    source = (
        "import torch\n"
        "from . import b\n"  # a module by a relative import
        "def f():\n"
        "    from pkg.c import thing\n"  # deferred, a name of a module
        "from .sub import *\n"
    )
    assert imports_in(source, "pkg.a", False, modules) == {"pkg.b": 2, "pkg.c": 4, "pkg.sub": 5}
    assert imports_in("from .a import x\nimport pkg.b.attr\n", "pkg", True, modules) == {"pkg.a": 1, "pkg.b": 2}
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 3}, "d": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c"]]
