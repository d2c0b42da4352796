"""The package layout: layers without cycles, imports at module level, a bottom layer that imports nothing
above it, modules of bounded size (docs/concepts/traced-core.md, "Layout")."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWN = ("eqjax", "pallas_kernels")
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in OWN:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


MODULES = _modules()


def _targets(node: ast.AST) -> list[str]:
    """eqjax / pallas_kernels modules an import statement loads (a package's ``__init__`` included)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module or node.module.split(".")[0] not in OWN:
            return []
        names = [f"{node.module}.{a.name}" for a in node.names]
        return [n if n in MODULES else node.module for n in names]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in OWN]
    return []


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Module-level import edges (with each target's parent packages, which Python runs first) and the
    function-level imports of own modules as ``(module, line, target)``."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    inner = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            for t in _targets(node):
                if id(node) not in top:
                    inner.append((mod, node.lineno, t))
                    continue
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    # a module's own parent packages are already being imported when it runs
                    if dep in MODULES and dep != mod and not mod.startswith(dep + "."):
                        edges[mod].add(dep)
    return edges, inner


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_no_function_level_imports_of_own_modules():
    _, inner = _graph()
    assert inner == [], "import these at module level: " + ", ".join(f"{m}:{n} -> {t}" for m, n, t in inner)


def test_the_bottom_layer_imports_nothing_above_it():
    edges, _ = _graph()
    bad = {m: sorted(t for t in ts if not t.startswith(("eqjax.core", "pallas_kernels")) and t != "eqjax")
           for m, ts in edges.items() if m.startswith("eqjax.core")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_kernels_import_nothing_of_eqjax():
    edges, _ = _graph()
    assert {m: sorted(ts) for m, ts in edges.items() if m.startswith("pallas_kernels") and any(
        t.startswith("eqjax") for t in ts)} == {}


def test_no_import_by_name_string():
    """Own modules are imported by statements, not through importlib (which would hide an edge)."""
    hits = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in MODULES.values()
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "import_module"
            and n.args and isinstance(n.args[0], ast.Constant) and str(n.args[0].value).startswith(OWN)]
    assert hits == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    assert len(MODULES[name].read_text().splitlines()) <= MAX_LINES


def test_every_package_has_an_init():
    dirs = {p.parent for p in MODULES.values()}
    assert sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").is_file()) == []
