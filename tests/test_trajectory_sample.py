"""Role-bounded path sampling: exact draws on hand-built trees, invariants on random ones, bad configs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_trajectory_pack import random_group

from gyre.trajectory import ROLES, PackConfig, SamplingConfig, TaskRecorder, build_packs, sample_branches

LP = [-0.5, -0.6, -0.7]


def hand_tree(second_execution: bool = False) -> TaskRecorder:
    """Execution 0: 3 model tokens, a sub-agent (2 model tokens), a sub-agent that ends with its summary
    (1 model token), a compaction, then 2 model tokens in the new context. Branch order: sub-agent (0),
    sub-agent-summary (1), main-summary (2), main (3). Execution 1 (optional): the same 3 model tokens (stored
    once in the trie), finished: branch 4, main."""
    rec = TaskRecorder("hand", [1, 2, 3])
    ex = rec.start()
    ex.append_model([10, 11, 12], LP, 0)
    sub = ex.fork()
    sub.append_env([50])
    sub.append_model([51, 52], LP[:2], 0)
    sub.close()
    sub2 = ex.fork()
    sub2.append_model([60], LP[:1], 0)
    sub2.close(summary=True)
    ex.compact([70, 71])
    ex.append_model([80, 81], LP[:2], 0)
    ex.finish(1.0)
    if second_execution:
        ex1 = rec.start()
        ex1.append_model([10, 11, 12], LP, 0)
        ex1.finish(0.0)
    return rec


def roles(cfg: SamplingConfig, seed: int = 0, second: bool = False):
    rec = hand_tree(second)
    return rec, build_packs([rec.tree], [np.array([0.5, -0.5])], PackConfig(max_tokens=64, normalization="sequence",
                                                                            sampling=cfg), np.random.default_rng(seed))


def trained_rows(batch):
    """(target token, execution, branch of the batch, weight) of every loss row, sorted."""
    out = []
    for p in batch.packs:
        r = p.rows
        out += list(zip(r.target.tolist(), r.execution.tolist(), r.branch.tolist(), r.weight.tolist()))
    return sorted(out)


def test_recorder_tags_roles():
    """The recorder tags a sub-agent, a sub-agent closed with its summary, a compacted and a final context."""
    rec = hand_tree(True)
    assert [ROLES[r] for r in rec.tree.branch_role] == ["sub-agent", "sub-agent-summary", "main-summary", "main",
                                                        "main"], rec.tree.branch_role
    assert rec.tree.preorder().branch_role.tolist() == rec.tree.branch_role, "the preorder keeps the roles"


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_default_priority_draws_one_leaf_per_class_in_role_order(seed):
    """With one leaf per class, the draw order is main, main-summary, sub-agent, sub-agent-summary whatever the
    seed, and each token is trained by the first drawn path through it (once)."""
    _, b = roles(SamplingConfig(mode="roles"), seed)
    assert b.branch_source.tolist() == [3, 2, 0, 1], f"drawn {b.branch_source.tolist()}"
    rows = trained_rows(b)
    # batch branch k is the k-th drawn path: main (80, 81), main-summary (10, 11, 12), sub (51, 52), summary (60)
    got = sorted((t, br) for t, _, br, _ in rows)
    want = sorted([(80, 0), (81, 0), (10, 1), (11, 1), (12, 1), (51, 2), (52, 2), (60, 3)])
    assert got == want, f"rows {got}"
    assert all(abs(w - 1 / 8) < 1e-15 for *_, w in rows), f"one execution: each of its 8 tokens weighs 1/8: {rows}"
    assert b.stats.kept_tokens == b.stats.unique_tokens == 14, "every token lies on a drawn path"


def test_j_max_caps_the_paths_and_the_packed_tokens():
    """J_max = 2 draws main then main-summary; the sub-agents' tokens are neither trained nor packed."""
    _, b = roles(SamplingConfig(mode="roles", j_max=2))
    assert b.branch_source.tolist() == [3, 2], f"drawn {b.branch_source.tolist()}"
    assert sorted(t for t, *_ in trained_rows(b)) == [10, 11, 12, 80, 81], trained_rows(b)
    # kept: prompt 3 + 10..12 (main-summary path) + the compacted root 70, 71 + 80, 81
    assert b.stats.kept_tokens == 10 and b.stats.packed_tokens == 10, b.stats
    _, one = roles(SamplingConfig(mode="roles", j_max=1))
    assert one.branch_source.tolist() == [3] and one.stats.kept_tokens == 4, (one.branch_source, one.stats)


def test_custom_priority_skips_a_class_whose_tokens_are_masked():
    """sub-agent first: its path masks 10..12, so main-summary (nothing left) is never drawn."""
    prio = ("sub-agent", "main", "main-summary", "sub-agent-summary")
    _, b = roles(SamplingConfig(mode="roles", role_priority=prio))
    assert b.branch_source.tolist() == [0, 3, 1], f"drawn {b.branch_source.tolist()}"
    assert sorted(t for t, *_ in trained_rows(b)) == [10, 11, 12, 51, 52, 60, 80, 81], trained_rows(b)


def test_weights_average_within_an_execution_then_across():
    """A token two executions share is trained once for each; weights: 1 / (2 x 8) for execution 0's 8 tokens,
    1 / (2 x 3) for execution 1's 3; each execution's weights sum to 1/2."""
    _, b = roles(SamplingConfig(mode="roles"), second=True)
    assert b.branch_source.tolist() == [3, 2, 0, 1, 4], b.branch_source.tolist()
    rows = trained_rows(b)
    per = {e: [w for _, x, _, w in rows if x == e] for e in (0, 1)}
    assert len(per[0]) == 8 and len(per[1]) == 3, f"rows per execution {per}"
    assert np.allclose(per[0], 1 / 16) and np.allclose(per[1], 1 / 6), per
    assert abs(sum(per[0]) - 0.5) < 1e-12 and abs(sum(per[1]) - 0.5) < 1e-12, "each execution weighs 1/2"
    shared = sorted((t, e) for t, e, _, _ in rows if t in (10, 11, 12))
    assert shared == [(10, 0), (10, 1), (11, 0), (11, 1), (12, 0), (12, 1)], f"shared tokens {shared}"


def test_draw_is_proportional_to_unmasked_tokens():
    """Two main leaves past a shared 2-token prefix with 1 and 3 tokens of their own: the first draw takes the
    longer one with probability 5/8 (2 + 3 of 2 + 1 + 2 + 3 tokens), over 4,000 seeds within 4 sigma."""
    rec = TaskRecorder("p", [1])
    ex = rec.start()
    pt = ex.append_model([5, 6], LP[:2], 0)
    ex.append_model([7], LP[:1], 0)
    ex.retry(pt)
    ex.append_model([8, 9, 4], LP, 0)
    ex.finish(0.0)
    pre = rec.tree.preorder()
    n = 4000
    first = [int(sample_branches(pre, SamplingConfig(mode="roles", j_max=1), np.random.default_rng(s))[0])
             for s in range(n)]
    share = np.mean(np.array(first) == 1)
    sd = np.sqrt(5 / 8 * 3 / 8 / n)
    assert abs(share - 5 / 8) < 4 * sd, f"longer leaf drawn first {share:.4f} of the time, expected 0.625"


def test_same_seed_same_draws_and_packs():
    """A seed fixes the draws and the packs; across 20 seeds the draws of a random batch differ."""
    rng = np.random.default_rng(3)
    recs = [random_group(rng, 4, 10)[0] for _ in range(2)]
    advs = [np.linspace(-1, 1, len(r.executions)) for r in recs]
    cfg = PackConfig(max_tokens=256, normalization="sequence", sampling=SamplingConfig(mode="roles", j_max=2))
    run = lambda s: build_packs([r.tree for r in recs], advs, cfg, np.random.default_rng(s))  # noqa: E731
    a, b = run(11), run(11)
    assert a.branch_source.tolist() == b.branch_source.tolist(), "same seed, other draws"
    for p, q in zip(a.packs, b.packs, strict=True):
        assert np.array_equal(p.input_ids, q.input_ids) and np.array_equal(p.rows.weight, q.rows.weight), "packs"
    assert len({tuple(run(s).branch_source.tolist()) for s in range(20)}) > 1, "the seed never changes the draw"


def test_sampling_needs_a_generator_and_bad_configs_name_the_field():
    """Role sampling without a Generator, J_max < 1, an unknown role or a missing role: one-line errors."""
    rec = hand_tree()
    with pytest.raises(ValueError, match="Generator"):
        build_packs([rec.tree], [np.zeros(1)], PackConfig(sampling=SamplingConfig(mode="roles")))
    with pytest.raises(ValueError, match=r"SamplingConfig.j_max must be an integer >= 1.*got 0"):
        SamplingConfig(mode="roles", j_max=0)
    with pytest.raises(ValueError, match="SamplingConfig.role_priority: unknown role 'critic'"):
        SamplingConfig(role_priority=("main", "critic", "sub-agent", "sub-agent-summary"))
    with pytest.raises(ValueError, match="SamplingConfig.role_priority must name each"):
        SamplingConfig(role_priority=("main", "sub-agent"))
    with pytest.raises(ValueError, match="SamplingConfig.mode"):
        SamplingConfig(mode="all")
    with pytest.raises(ValueError, match="branch role 'boss'"):
        rec.tree.add_branch(0, 0, "boss")


def independent_draw_check(tree, source, exe, roles_arr, prio, j_max):
    """From parent pointers and sets alone: per execution, each draw took a leaf of the best class that still had
    unmasked trainable tokens, at most j_max draws, and it stopped only at j_max or with nothing left. Returns
    the set of (buffer token, execution) each drawn path newly trains, per drawn path."""
    par, trained = tree.parent, tree.trained
    leaves = tree.branch_leaf

    def path(b):
        q, out = leaves[b], []
        while q >= 0:
            out.append(q)
            q = int(par[q])
        return [q for q in out if trained[q] and par[q] >= 0]

    rank = {r: i for i, r in enumerate(prio)}
    news = []
    for e in sorted(set(exe)):
        mine = [b for b in range(len(leaves)) if exe[b] == e]
        drawn = [b for b in source if exe[b] == e]
        assert len(drawn) <= j_max, f"execution {e}: {len(drawn)} paths > J_max {j_max}"
        masked: set[int] = set()
        for b in drawn:
            live = [c for c in mine if set(path(c)) - masked]
            best = min(rank[ROLES[roles_arr[c]]] for c in live)
            assert rank[ROLES[roles_arr[b]]] == best, f"execution {e}: drew a lower class while a higher had tokens"
            assert b in live, f"execution {e}: drew leaf {b} with nothing unmasked"
            new = set(path(b)) - masked
            news.append((e, new))
            masked |= new
        if len(drawn) < j_max:
            assert not any(set(path(c)) - masked for c in mine), f"execution {e}: stopped with tokens left"
    return news


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), j_max=st.sampled_from([1, 2, 5, None]), perm=st.permutations(list(ROLES)))
def test_random_trees_every_drawn_token_trains_once_and_classes_come_in_order(seed, j_max, perm):
    """Random groups with random roles: draws respect the class order and J_max, and the packed rows are exactly
    the (token, execution) pairs the drawn paths newly train, each once."""
    rng = np.random.default_rng(seed)
    rec, _ = random_group(rng, 3, 8)
    tree = rec.tree
    tree.branch_role = rng.integers(0, len(ROLES), len(tree.branch_leaf)).tolist()
    cfg = SamplingConfig(mode="roles", j_max=j_max, role_priority=tuple(perm))
    b = build_packs([tree], [np.ones(len(rec.executions))], PackConfig(max_tokens=512, sampling=cfg),
                    np.random.default_rng(seed))
    src = b.branch_source.tolist()
    news = independent_draw_check(tree, src, tree.branch_execution, tree.branch_role, perm, j_max or 10**9)
    want = sorted((int(tree.tokens[q]), e) for e, new in news for q in new)
    got = sorted((t, e) for t, e, _, _ in trained_rows(b))
    assert got == want, f"rows {got} != drawn paths' new tokens {want}"
    assert b.stats.loss_rows == len(want), "row count"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.floats(0.0, 1.0))
def test_restrict_keeps_exactly_the_paths_of_the_chosen_branches(seed, share):
    """A random subset of branches: the cut tree holds exactly the union of their paths, each path reads the same
    tokens root to leaf, subtree ends follow from the parent pointers, and run starts hold every fork child."""
    from gyre.trajectory import restrict

    rng = np.random.default_rng(seed)
    rec, _ = random_group(rng, 3, 8)
    pre = rec.tree.preorder()
    chosen = np.flatnonzero(rng.random(len(pre.branch_leaf)) < share)
    cut = restrict(pre, chosen)

    def walk(p, q):
        out = []
        while q >= 0:
            out.append(q)
            q = int(p.parent[q])
        return out[::-1]

    union = set()
    for k, b in enumerate(chosen.tolist()):
        old, new = walk(pre, int(pre.branch_leaf[b])), walk(cut, int(cut.branch_leaf[k]))
        union |= set(old)
        for f in ("tokens", "depth", "trained", "logprob"):
            assert np.array_equal(getattr(pre, f)[old], getattr(cut, f)[new]), f"branch {b}: {f} differs"
    assert cut.size == len(union), f"{cut.size} tokens kept, the paths hold {len(union)}"
    end = np.arange(1, cut.size + 1)
    for q in range(cut.size - 1, -1, -1):
        if cut.parent[q] >= 0:
            end[cut.parent[q]] = max(end[cut.parent[q]], end[q])
    assert np.array_equal(end, cut.leave), "subtree ends"
    kids = np.bincount(cut.parent[cut.parent >= 0], minlength=cut.size)
    need = {q for q in range(cut.size) if cut.parent[q] < 0 or kids[cut.parent[q]] > 1}
    starts = cut.run_start.tolist()
    assert starts == sorted(set(starts)) and need <= set(starts), f"run starts {starts} miss {need - set(starts)}"
    inner = [q for q in range(cut.size) if q not in set(starts)]
    assert all(cut.parent[q] == q - 1 for q in inner), "a token inside a run continues the previous one"
