"""Property tests: random branching executions -> trees -> packs reconstruct every branch exactly."""

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.trajectory import PackConfig, TaskRecorder, build_packs, merge_by_sign


def lp_of(tok: int, depth: int) -> float:
    """Deterministic old log-prob so identical tokens at the same depth merge across executions."""
    return -1.0 - 0.1 * tok - 0.002 * depth


def random_group(rng: np.random.Generator, n_exec: int, n_ops: int, vocab: int = 3):
    """A recorder with random appends, sub-agents, retries, compactions; plus the branches seen, tracked apart.

    Returns (recorder, branches) where each branch is (execution, tokens, trained, old_logprobs) lists, in the
    order the recorder closes them.
    """
    prompt = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
    rec = TaskRecorder("t", prompt)
    branches = []

    def run(cur, state, ops, allow_compact):
        toks, trained, lps, marks = state
        for _ in range(ops):
            op = rng.choice(["model", "model", "env", "fork", "retry", "compact"])
            if op == "model" or (op == "compact" and not allow_compact):
                new = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
                nl = [lp_of(t, len(toks) + i) for i, t in enumerate(new)]
                pt = cur.append_model(new, nl, 0)
                toks, trained, lps = toks + new, trained + [True] * len(new), lps + nl
                marks.append((len(toks), pt))
            elif op == "env":
                new = rng.integers(0, vocab, int(rng.integers(1, 3))).tolist()
                pt = cur.append_env(new)
                toks, trained, lps = toks + new, trained + [False] * len(new), lps + [0.0] * len(new)
                marks.append((len(toks), pt))
            elif op == "fork":
                n, pt = marks[int(rng.integers(len(marks)))]
                sub = cur.fork(pt)
                run(sub, (toks[:n], trained[:n], lps[:n], [(n, pt)]), int(rng.integers(0, 4)), False)
                sub.close()
            elif op == "retry":
                k = int(rng.integers(len(marks)))
                n, pt = marks[k]
                if n != len(toks):
                    branches.append((ex_id, toks, trained, lps))
                cur.retry(pt)
                toks, trained, lps, marks = toks[:n], trained[:n], lps[:n], marks[: k + 1]
            else:
                branches.append((ex_id, toks, trained, lps))
                new = rng.integers(0, vocab, int(rng.integers(1, 3))).tolist()
                pt = cur.compact(new)
                toks, trained, lps, marks = new, [False] * len(new), [0.0] * len(new), [(len(new), pt)]
        branches.append((ex_id, toks, trained, lps))

    for ex_id in range(n_exec):
        ex = rec.start()
        state = (list(prompt), [False] * len(prompt), [0.0] * len(prompt), [(len(prompt), ex.point)])
        run(ex, state, n_ops, True)
        if rng.random() < 0.3:
            ex.hit_deadline()
        else:
            ex.finish(float(rng.normal()))
    return rec, branches


def check_batch(recs_and_branches, max_tokens: int, advantages):
    trees = [rec.tree for rec, _ in recs_and_branches]
    batch = build_packs(trees, advantages, PackConfig(max_tokens=max_tokens))
    all_branches = [b for _, bs in recs_and_branches for b in bs]
    eoff = np.cumsum([0] + [len(rec.executions) for rec, _ in recs_and_branches])
    gexec = [int(eoff[i]) + b[0] for i, (_, bs) in enumerate(recs_and_branches) for b in bs]
    assert len(batch.branch_pack) == len(all_branches), "one located leaf per recorded branch"
    for p in batch.packs:
        assert p.size <= max_tokens, f"pack of {p.size} tokens exceeds bound {max_tokens}"
    rows_by_branch = {}
    for pi, p in enumerate(batch.packs):
        for j in range(len(p.rows)):
            rows_by_branch.setdefault(int(p.rows.branch[j]), []).append((pi, j))
    for bi, (e, toks, trained, lps) in enumerate(all_branches):
        p = batch.packs[batch.branch_pack[bi]]
        anc = p.ancestors(int(batch.branch_index[bi]))
        assert p.input_ids[anc].tolist() == toks, f"branch {bi} does not reconstruct"
        assert p.position_ids[anc].tolist() == list(range(len(toks))), f"branch {bi} positions are not depths"
        assert int(batch.branch_execution[bi]) == gexec[bi], f"branch {bi} has the wrong execution"
        want = [i for i in range(1, len(toks)) if trained[i]]
        got = sorted(rows_by_branch.get(bi, []),
                     key=lambda r: batch.packs[r[0]].position_ids[batch.packs[r[0]].rows.pred[r[1]]])
        assert len(got) == len(want), f"branch {bi}: {len(got)} loss rows, naive has {len(want)}"
        for i, (pi, j) in zip(want, got):
            q = batch.packs[pi]
            pred = int(q.rows.pred[j])
            assert q.input_ids[q.ancestors(pred)].tolist() == toks[:i], f"branch {bi}: context of target {i}"
            assert int(q.rows.target[j]) == toks[i] and q.rows.old_logprob[j] == lps[i], f"branch {bi}: target {i}"
            assert int(q.rows.execution[j]) == gexec[bi], f"branch {bi}: row execution"
    s = batch.stats
    assert s.naive_tokens == sum(len(b[1]) for b in all_branches), "naive token count"
    assert s.unique_tokens == sum(t.size for t in trees), "unique token count"
    assert s.packed_tokens == sum(p.size for p in batch.packs), "packed token count"
    assert s.loss_rows == sum(sum(b[2][1:]) for b in all_branches), "rows = naive trained tokens"
    return batch


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n_exec=st.integers(1, 4), n_ops=st.integers(1, 10), n_tasks=st.integers(1, 3),
       slack=st.integers(0, 30))
def test_random_groups_reconstruct_and_respect_bound(seed, n_exec, n_ops, n_tasks, slack):
    """Every branch reconstructs from packs, each trained token has its naive multiplicity, packs are bounded."""
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_tasks):
        rec, branches = random_group(rng, n_exec, n_ops)
        groups.append((rec, branches))
    deepest = max(len(b[1]) for _, bs in groups for b in bs)
    advantages = [rng.normal(size=len(rec.executions)) for rec, _ in groups]
    check_batch(groups, deepest + slack, advantages)


@settings(deadline=None)
@given(seed=st.integers(0, 2**31))
def test_merged_rows_preserve_coefficients_by_sign(seed):
    """Merging rows by (pred, target, sign) keeps, per sign, the sum of weight * advantage."""
    rng = np.random.default_rng(seed)
    rec, _ = random_group(rng, 4, 6)
    batch = build_packs([rec.tree], [rng.normal(size=4)], PackConfig(max_tokens=200))
    for p in batch.packs:
        m = merge_by_sign(p.rows)
        coef = p.rows.weight * p.rows.advantage
        for sgn in (1, -1):
            want = {}
            for pr, tg, c in zip(p.rows.pred, p.rows.target, coef):
                if np.sign(c) == sgn:
                    want[(int(pr), int(tg))] = want.get((int(pr), int(tg)), 0.0) + c
            got = {(int(pr), int(tg)): c for pr, tg, c in zip(m.pred, m.target, m.advantage) if np.sign(c) == sgn}
            assert got.keys() == want.keys(), "merged groups differ"
            assert all(np.isclose(got[k], want[k], rtol=1e-12, atol=0) for k in want), "merged coefficient"


def exhaustive_min_replay(depth: np.ndarray, bound: int) -> int:
    """Least total replayed context over every partition of the preorder into fitting chunks (O(n * bound))."""
    n = depth.shape[0]
    f = [None] * (n + 1)
    f[0] = 0
    for a in range(n):
        if f[a] is None:
            continue
        for b in range(a + 1, min(n, a + bound - int(depth[a])) + 1):
            c = f[a] + (int(depth[b]) if b < n else 0)
            if f[b] is None or c < f[b]:
                f[b] = c
    return f[n]


@settings(deadline=None)
@given(seed=st.integers(0, 2**31), slack=st.integers(0, 12))
def test_cuts_replay_as_little_as_any_partition(seed, slack):
    """The chosen cut points replay exactly as few context tokens as the best of all possible partitions."""
    rng = np.random.default_rng(seed)
    rec, _ = random_group(rng, 3, 10)
    pre = rec.tree.preorder()
    bound = int(pre.depth.max()) + 1 + slack
    batch = build_packs([pre], [np.zeros(3)], PackConfig(max_tokens=bound))
    best = exhaustive_min_replay(pre.depth, bound)
    assert batch.stats.packed_tokens - pre.size == best, f"replayed {batch.stats.packed_tokens - pre.size} > {best}"


def test_same_seed_same_packs():
    """Packing is deterministic: the same seed yields identical packs."""
    out = []
    for _ in range(2):
        rng = np.random.default_rng(7)
        rec, _ = random_group(rng, 3, 8)
        b = build_packs([rec.tree], [np.ones(3)], PackConfig(max_tokens=40))
        out.append([(p.input_ids.tolist(), p.leave.tolist(), p.rows.pred.tolist()) for p in b.packs])
    assert out[0] == out[1], "two runs with one seed differ"


def test_split_cost_is_small_on_a_forest_of_siblings():
    """Many siblings under a short shared prompt pack with only the prompt replayed per pack."""
    rec = TaskRecorder("t", [0, 1])
    for e in range(6):
        ex = rec.start()
        ex.append_model(np.full(10, e + 2), np.full(10, -0.5), 0)
        ex.finish(0.0)
    b = build_packs([rec.tree], [np.zeros(6)], PackConfig(max_tokens=24))
    assert b.stats.unique_tokens == 62 and b.stats.num_packs == 3, f"unexpected packing {b.stats}"
    assert b.stats.packed_tokens == 66, "two siblings per pack, prompt replayed twice"


def test_trajectory_package_imports_without_torch():
    """gyre.trajectory (all but torch_ops) imports with torch blocked."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gyre.trajectory, gyre.trajectory.pack, gyre.trajectory.credit\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"importing gyre.trajectory needed torch: {r.stderr[-500:]}"
