"""The package's import graph (issue #48): kernels are leaves and nothing imports in a circle.

Read from the source with `ast`, every import statement counted, those inside functions too
(a lazy import is still a dependency); nothing is imported, nothing compiled. A `from P import
n` is an edge to the submodule P.n when there is one, else to P; a parent package a submodule
import runs implicitly is not an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import redknot_jax

ROOT = Path(redknot_jax.__file__).parent
PKG = "redknot_jax"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PKG,) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any statement, any depth)."""
    mods = _modules()

    def target(name: str) -> str | None:
        while name and name not in mods:  # `import a.b.c` of a name inside a module: that module
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [target(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else target(base) for a in node.names]
            else:
                continue
            edges.update(f for f in found if f is not None and f.startswith(PKG) and f != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_sees_lazy_imports():
    """The reader counts imports inside functions and `from package import submodule`."""
    g = import_graph()
    assert "redknot_jax.pallas.indexer_scores" in g["redknot_jax.pallas"]  # lazy, in resolve_kernels
    assert "redknot_jax.reuse.codec" in g["redknot_jax.reuse.layer"]  # `from redknot_jax.reuse import codec`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_import_no_reuse_module():
    """Nothing under redknot_jax/pallas imports redknot_jax.reuse: a kernel file holds its kernel,
    reference, config and benchmark, and takes anything else from modules below the runtime."""
    bad = {m: sorted(e for e in edges if e == f"{PKG}.reuse" or e.startswith(f"{PKG}.reuse."))
           for m, edges in import_graph().items() if m == f"{PKG}.pallas" or m.startswith(f"{PKG}.pallas.")}
    assert not {m: e for m, e in bad.items() if e}, bad


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
