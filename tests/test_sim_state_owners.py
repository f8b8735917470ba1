"""Each piece of simulator state has one writer: an execution's phase and version credit change only in its own
methods (gyre.sim.cluster.execution), its KV fields and its engine's KV counters only in the engine's KvLedger
(gyre.sim.cluster.kv_ledger); anywhere else in sim/ they are read, never assigned (but for initial values in a
constructor)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNERS = {
    "sim/cluster/execution.py": ("phase", "vsum", "seg_cred", "first_version", "base_seg", "base_vsum", "base_fv"),
    "sim/cluster/kv_ledger.py": ("resident", "pf_left", "reserved", "holds", "mem_fixed", "n_dec", "kv_dec_base",
                                 "pf_pending", "pf_resident", "holders"),
}


def _writes(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """(line, field) of every assignment to an attribute named in `fields` outside an `__init__`."""
    found = []

    def visit(node: ast.AST, in_init: bool) -> None:
        for child in ast.iter_child_nodes(node):
            init = in_init or (isinstance(child, ast.FunctionDef) and child.name == "__init__")
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Attribute) and n.attr in fields and not init:
                        found.append((n.lineno, n.attr))
            visit(child, init)

    visit(ast.parse(source), False)
    return found


def test_only_the_owner_writes_its_fields():
    """No module in sim/ but the owner assigns an execution's phase or version credit, or the KV books."""
    stray = []
    for f in sorted((ROOT / "sim").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        for owner, fields in OWNERS.items():
            if rel != owner:
                stray += [f"{rel}:{line} writes .{attr} ({owner} owns it)"
                          for line, attr in _writes(f.read_text(), set(fields))]
    assert not stray, "\n".join(stray)


def test_the_check_sees_a_stray_write():
    """The scan finds direct, augmented, tuple and chained writes, and lets a constructor set initial values."""
    src = ("def f(ex, e):\n    ex.phase = 1\n    ex.vsum += 2\n    a, e.kv.n_dec = 1, 2\n    x = ex.vsum\n"
           "class C:\n    def __init__(self):\n        self.phase = 0\n")
    assert _writes(src, {"phase", "vsum", "n_dec"}) == [(2, "phase"), (3, "vsum"), (4, "n_dec")], "scan"
