"""A streaming step's micro-step is one execution's part of its group's tree (gyre.trajectory.Preorder.of_execution)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # the random tree generator lives beside this file
from test_trajectory_pack import random_group  # noqa: E402

from gyre.trajectory import PackConfig, build_packs  # noqa: E402


def paths(pre) -> list[tuple[int, list[int], list[bool], list[float]]]:
    """(execution, tokens, trained, old log-probs) of each branch, by walking parent pointers."""
    out = []
    for leaf, e in zip(pre.branch_leaf.tolist(), pre.branch_execution.tolist()):
        idx = []
        while leaf >= 0:
            idx.append(leaf)
            leaf = int(pre.parent[leaf])
        idx = idx[::-1]
        out.append((e, pre.tokens[idx].tolist(), pre.trained[idx].tolist(), pre.logprob[idx].tolist()))
    return out


def test_an_executions_tree_holds_its_branches_and_rows_and_nothing_else():
    """Over random groups (sub-agents, retries, compactions): each execution's tree reproduces exactly its
    branches in order, is a valid preorder (depth = parent's + 1, subtrees nested), holds only tokens on them,
    and packs into exactly the loss rows the whole tree gives that execution."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        rec, _ = random_group(rng, int(rng.integers(1, 5)), int(rng.integers(1, 10)), vocab=5)
        pre = rec.tree.preorder()
        whole = build_packs([pre], [np.arange(len(rec.executions), dtype=float) + 1.0], PackConfig(max_tokens=64))
        rows = {}
        for p in whole.packs:
            for e, t, lp in zip(p.rows.execution.tolist(), p.rows.target.tolist(), p.rows.old_logprob.tolist()):
                rows.setdefault(e, []).append((t, lp))
        for e in range(len(rec.executions)):
            sub = pre.of_execution(e)
            want = [(0, *b[1:]) for b in paths(pre) if b[0] == e]
            assert paths(sub) == want, f"execution {e}: its branches differ"
            on_path = {i for b in range(len(sub.branch_leaf)) for i in sub.path(int(sub.branch_leaf[b]))}
            assert on_path == set(range(sub.size)), f"execution {e}: tokens on none of its branches"
            par = sub.parent
            ok = np.where(par >= 0, sub.depth == sub.depth[np.maximum(par, 0)] + 1, sub.depth == 0)
            assert ok.all() and (par < np.arange(sub.size)).all(), f"execution {e}: not a preorder"
            inside = [(sub.leave[i] <= sub.leave[par[i]]) for i in range(sub.size) if par[i] >= 0]
            assert all(inside), f"execution {e}: a subtree is not nested in its parent's"
            if not sub.size:
                assert e not in rows, f"execution {e}: rows but an empty tree"
                continue
            mine = build_packs([sub], [[float(e) + 1.0]], PackConfig(max_tokens=64))
            got = sorted((t, lp) for p in mine.packs for t, lp in zip(p.rows.target.tolist(),
                                                                      p.rows.old_logprob.tolist()))
            assert got == sorted(rows.get(e, [])), f"execution {e}: its loss rows differ from the whole tree's"
            adv = {float(a) for p in mine.packs for a in p.rows.advantage}
            assert adv <= {float(e) + 1.0}, f"execution {e}: advantages {adv}"
