"""Worked scenarios of the recording API (sub-agent, retry, compaction), partial credit and bad input."""

import numpy as np
import pytest

from gyre.trajectory import (
    AdvantageConfig, PackConfig, Point, TaskRecorder, build_packs, group_advantages, score_group,
)


def rows_of(pack):
    r = pack.rows
    return list(zip(r.pred.tolist(), r.target.tolist(), r.branch.tolist()))


def test_subagent_tree_and_packs_exact():
    """A sub-agent forked mid-context is a child at its fork point; packs and rows are exact, split or not."""
    rec = TaskRecorder("t", [1, 2])
    ex = rec.start()
    ex.append_model([3, 4], [-0.1, -0.2], 0)
    sub = ex.fork()
    sub.append_model([5], [-0.3], 0)
    sub.close()
    ex.append_env([6])
    ex.append_model([7], [-0.4], 0)
    ex.finish(1.0)
    t = rec.tree
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7], "tree tokens"
    assert t.parent.tolist() == [-1, 0, 1, 2, 3, 3, 5], "sub-agent and main line both hang under token 4"
    assert t.branch_leaf == [4, 6] and t.branch_execution == [0, 0], "two branches of execution 0"
    pre = t.preorder()
    assert pre.depth.tolist() == [0, 1, 2, 3, 4, 4, 5], "depths"
    assert pre.leave.tolist() == [7, 7, 7, 7, 5, 7, 7], "subtree ends"
    assert pre.executions_through(3).tolist() == [0], "executions through the fork point"

    one = build_packs([t], [np.array([1.0])], PackConfig(max_tokens=16))
    (p,) = one.packs
    assert p.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and p.position_ids.tolist() == [0, 1, 2, 3, 4, 4, 5], "pack"
    assert rows_of(p) == [(1, 3, 0), (2, 4, 0), (1, 3, 1), (2, 4, 1), (3, 5, 0), (5, 7, 1)], "rows"
    assert (one.stats.unique_tokens, one.stats.naive_tokens, one.stats.packed_tokens) == (7, 11, 7), "stats"

    split = build_packs([t], [np.array([1.0])], PackConfig(max_tokens=6))
    a, b = split.packs
    assert a.input_ids.tolist() == [1, 2, 3, 4, 6, 7] and a.position_ids.tolist() == [0, 1, 2, 3, 4, 5], "replay"
    assert a.leave.tolist() == [6] * 6 and rows_of(a) == [(4, 7, 1)], "main-line chunk with replayed context"
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5], "sub-agent chunk"
    assert rows_of(b) == [(1, 3, 0), (2, 4, 0), (1, 3, 1), (2, 4, 1), (3, 5, 0)], "rows of the first chunk"
    assert split.stats.packed_tokens == 11, "cut placed after the fork: 4 replayed tokens"


def test_retry_tree_and_packs_exact():
    """A retry keeps the abandoned attempt as its own branch and continues from the earlier point."""
    rec = TaskRecorder("t", [1])
    ex = rec.start()
    p = ex.append_model([2], [-0.1], 0)
    ex.append_model([3, 4], [-0.2, -0.3], 0)
    ex.retry(p)
    ex.append_model([5], [-0.5], 1)
    ex.finish(0.0)
    t = rec.tree
    assert t.tokens.tolist() == [1, 2, 3, 4, 5] and t.parent.tolist() == [-1, 0, 1, 2, 1], "retry is a child of 2"
    assert t.branch_leaf == [3, 4], "abandoned attempt then final attempt"
    assert t.version.tolist() == [-1, 0, 0, 0, 1], "policy versions kept per token"
    (pk,) = build_packs([t], [np.array([2.0])], PackConfig(max_tokens=8)).packs
    assert pk.position_ids.tolist() == [0, 1, 2, 3, 2] and pk.leave.tolist() == [5, 5, 4, 4, 5], "layout"
    assert rows_of(pk) == [(0, 2, 0), (0, 2, 1), (1, 3, 0), (2, 4, 0), (1, 5, 1)], "rows"
    assert pk.rows.old_logprob.tolist() == [-0.1, -0.1, -0.2, -0.3, -0.5], "old log-probs"
    assert pk.rows.advantage.tolist() == [2.0] * 5, "execution advantage on every row"


def test_compaction_tree_and_packs_exact():
    """Compaction closes the context and starts a new root linked to the old leaf; roots pack apart."""
    rec = TaskRecorder("t", [1, 2])
    ex = rec.start()
    ex.append_model([3], [-0.1], 0)
    link_to = ex.compact([7, 8])
    ex.append_model([4], [-0.2], 0)
    ex.finish(1.0)
    t = rec.tree
    assert t.tokens.tolist() == [1, 2, 3, 7, 8, 4] and t.parent.tolist() == [-1, 0, 1, -1, 3, 4], "two roots"
    assert ex.links == [(Point("t", 2), link_to)] and link_to.index == 4, "link old leaf -> new context"
    assert t.branch_leaf == [2, 5], "one branch per context"
    (pk,) = build_packs([t], [np.array([1.0])], PackConfig(max_tokens=16)).packs
    assert pk.position_ids.tolist() == [0, 1, 2, 0, 1, 2], "positions restart at the new root"
    assert pk.leave.tolist() == [3, 3, 3, 6, 6, 6], "the two roots never attend each other"
    assert rows_of(pk) == [(1, 3, 0), (4, 4, 1)], "rows"
    packs = build_packs([t], [np.array([1.0])], PackConfig(max_tokens=3)).packs
    assert [p.input_ids.tolist() for p in packs] == [[1, 2, 3], [7, 8, 4]], "cut at the root: nothing replayed"


def test_group_prompt_and_identical_prefixes_are_stored_once():
    """Executions of a group share the prompt and any identical leading model tokens."""
    rec = TaskRecorder("t", [1, 2, 3])
    for tail in ([9], [8]):
        ex = rec.start()
        ex.append_model([4, 5], [-0.5, -0.5], 0)
        ex.append_model(tail, [-1.0], 0)
        ex.finish(0.0)
    t = rec.tree
    assert t.size == 7, f"expected 7 unique tokens, got {t.size}"
    pre = t.preorder()
    assert pre.executions_through(4).tolist() == [0, 1], "shared token knows both executions"
    assert pre.executions_through(5).tolist() == [0], "divergent token knows only its execution"


def test_partial_credit_keeps_truncated_in_baseline():
    """A deadline-hit execution is scored on its reached state, flagged, and counted in the group mean."""
    rec = TaskRecorder("t", [1])
    a, b, c = rec.start(), rec.start(), rec.start()
    a.append_model([2], [-0.1], 0)
    a.finish(1.0)
    b.append_model([3, 3, 3], [-0.1] * 3, 0)
    b.hit_deadline()
    c.finish(0.0)
    seen = []

    def credit(state):
        seen.append((state.execution, state.context_tokens.tolist(), state.generated_tokens, state.truncated))
        return 0.5

    out = score_group(rec, credit)
    assert seen == [(1, [1, 3, 3, 3], 3, True)], "reward function sees the reached state"
    assert [(o.reward, o.truncated) for o in out] == [(1.0, False), (0.5, True), (0.0, False)], "outcomes"
    assert np.allclose(group_advantages(out), [0.5, 0.0, -0.5]), "baseline includes the truncated run"
    adv = group_advantages(out, AdvantageConfig(normalize_std=True, eps=0.0))
    assert np.allclose(adv, np.array([0.5, 0.0, -0.5]) / np.std([1.0, 0.5, 0.0])), "std-normalized"


def test_malformed_input_raises_clear_errors():
    """Forks from unknown nodes, tokens after finish and other misuse raise one-line ValueErrors."""
    rec = TaskRecorder("t", [1, 2])
    other = TaskRecorder("u", [1, 2])
    ex = rec.start()
    p = ex.append_model([3], [-0.1], 0)
    with pytest.raises(ValueError, match="unknown node 999"):
        ex.fork(Point("t", 999))
    with pytest.raises(ValueError, match="not a point of task"):
        ex.fork(other.start().point)
    q = ex.append_model([4], [-0.1], 0)
    ex.retry(p)
    with pytest.raises(ValueError, match="unknown node"):
        ex.retry(q)  # q is on the abandoned attempt, not the current context
    with pytest.raises(ValueError, match="log-probs"):
        ex.append_model([5, 6], [-0.1], 0)
    with pytest.raises(ValueError, match="still running"):
        score_group(rec, lambda s: 0.0)
    ex.finish(1.0)
    with pytest.raises(ValueError, match="finished.*cannot append tokens"):
        ex.append_model([5], [-0.1], 0)
    with pytest.raises(ValueError, match="cannot append tokens"):
        ex.append_env([5])
    with pytest.raises(ValueError, match="cannot finish"):
        ex.finish(1.0)
    with pytest.raises(ValueError, match="more than max_tokens=2"):
        build_packs([rec.tree], [np.array([0.0])], PackConfig(max_tokens=2))
    with pytest.raises(ValueError, match="normalization"):
        PackConfig(normalization="batch")
