"""The package's import graph has no cycle, lazy in-function imports included, and building a config needs no Ray.

The graph is read from the source with `ast`, not by importing: every `import` and `from ... import` statement of
every module under the folders pyproject maps to `gyre.*`, at any depth (inside functions too), except those under
`if TYPE_CHECKING:` (never executed). `from package import name` is an edge to `package.name` when that is a module,
else to `package` itself. A parent package's `__init__` that Python runs on the way is not an edge of its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"gyre": "gyre", "policies": "gyre.policies", "sim": "gyre.sim", "real": "gyre.real", "bridge": "gyre.bridge"}


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            out[name] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package that `name` imports anywhere in its source (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_walker_sees_lazy_imports_and_skips_type_checking(tmp_path):
    """The walker finds an import inside a function and a relative one, and ignores a TYPE_CHECKING block."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import c\n"
                                   "def f():\n    from . import b\n    import p.d\n")
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    got = imports("p.a", tmp_path / "a.py", known)
    assert got == {"p.b", "p.d"}, got
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]], "a 3-cycle is found"


def test_no_import_cycles_lazy_ones_included():
    """No set of the package's modules imports one another in a circle, counting imports inside functions."""
    mods = modules()
    known = set(mods)
    graph = {m: imports(m, p, known) for m, p in mods.items()}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


BUILD_CONFIGS = """
import sys
from gyre.presets import PRESETS, get_preset
from gyre.config import override
for name in PRESETS:
    cfg = get_preset(name)
    cfg.validate()
    cfg.costs()
import gyre.real.config as rc
built = [getattr(rc, n)() for n in dir(rc) if n.startswith("preset_")]
from gyre.real.config_file import load_config
bad = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
print("built", len(built), "ray modules:", bad[:5])
sys.exit(1 if bad or not built else 0)
"""


def test_building_any_config_imports_no_ray():
    """Building every simulator preset and every real-backend preset config (and loading the TOML reader) leaves
    no `ray` module in sys.modules."""
    out = subprocess.run([sys.executable, "-c", BUILD_CONFIGS], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
