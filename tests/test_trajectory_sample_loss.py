"""Role-sampled packed loss and gradients equal a naive per-path reference (tiny fp64 transformer on CPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trajectory_loss import CFG, LOSS, assert_same, grads_of  # noqa: E402
from test_trajectory_pack import random_group  # noqa: E402
from test_trajectory_sample import independent_draw_check  # noqa: E402

from gyre.real.nn.model import TinyLlama  # noqa: E402
from gyre.trajectory import ROLES, PackConfig, SamplingConfig, build_packs  # noqa: E402
from gyre.trajectory.torch_ops import Branch, naive_loss, packed_loss  # noqa: E402


def reference_branches(tree, source, adv, offset, prio, j_max):
    """Each drawn path as its own causal sequence (walked by parent pointers), training only the tokens it newly
    trains for its execution (checked against the draw rules by independent_draw_check)."""
    news = independent_draw_check(tree, source, tree.branch_execution, tree.branch_role, prio, j_max)
    out = []
    for b, (e, new) in zip(source, news, strict=True):
        q, idx = tree.branch_leaf[b], []
        while q >= 0:
            idx.append(q)
            q = int(tree.parent[q])
        idx = idx[::-1]
        out.append(Branch(tokens=tree.tokens[idx], trained=np.array([i in new for i in idx]),
                          old_logprob=tree.logprob[idx], execution=e + offset, advantage=float(adv[e])))
    return out


@pytest.mark.parametrize("seed,j_max", [(0, 1), (1, 3), (0, None)])
def test_sampled_packed_loss_equals_naive_per_path_loss(seed, j_max):
    """Mean over each execution's trained tokens, then across executions: packed (one pack or split at the deepest
    context) equals the per-path reference in loss and every gradient."""
    model = TinyLlama(CFG, np.random.default_rng(200 + seed), dtype=torch.float64)
    rng = np.random.default_rng(seed)
    trees, advs = [], []
    for _ in range(2):
        rec, _ = random_group(rng, 3, 8)
        rec.tree.branch_role = rng.integers(0, len(ROLES), len(rec.tree.branch_leaf)).tolist()
        trees.append(rec.tree)
        advs.append(rng.normal(size=len(rec.executions)))
    cfg = SamplingConfig(mode="roles", j_max=j_max)
    deepest = max(int(t.preorder().depth.max()) + 1 for t in trees)
    for bound in (10_000, deepest):
        batch = build_packs(trees, advs, PackConfig(max_tokens=bound, normalization="sequence", sampling=cfg),
                            np.random.default_rng(seed))
        src = batch.branch_source.tolist()
        ref_br, off = [], 0
        gexe = batch.branch_execution
        for t, a in zip(trees, advs):
            mine = [s for s, e in zip(src, gexe.tolist()) if off <= e < off + len(a)]
            ref_br += reference_branches(t, mine, a, off, cfg.role_priority, j_max or 10**9)
            off += len(a)
        assert len(ref_br) == len(src), "every drawn path belongs to a tree"
        ref = grads_of(model, [lambda: naive_loss(model, ref_br, "sequence", LOSS)])
        assert ref[0] != 0.0, "reference loss is trivial"
        got = grads_of(model, [lambda: packed_loss(model, batch.packs, LOSS)])
        assert_same(got, ref, f"bound {bound}, J_max {j_max}")
