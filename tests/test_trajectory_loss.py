"""Packed loss and gradients equal the naive per-branch reference (tiny fp64 transformer on CPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the random scenario generator lives beside this file
from test_trajectory_pack import random_group  # noqa: E402

from gyre.real.nn.model import TinyLlamaConfig, TinyLlama  # noqa: E402
from gyre.trajectory import PackConfig, build_packs, group_advantages, merge_by_sign, score_group  # noqa: E402
from gyre.trajectory.pack import Pack  # noqa: E402
from gyre.trajectory.torch_ops import (  # noqa: E402
    Branch, LossConfig, block_mask, branches_of, dense_mask, naive_loss, packed_loss,
)

CFG = TinyLlamaConfig(vocab_size=3, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, init_std=0.4)
LOSS = LossConfig(clip_low=0.2, clip_high=0.28)


def scenario(seed: int, n_tasks: int = 2):
    """Random groups, scored with partial credit, and the naive branches tracked by the generator."""
    rng = np.random.default_rng(seed)
    trees, advs, branches, off = [], [], [], 0
    for _ in range(n_tasks):
        rec, bs = random_group(rng, 3, 8)
        adv = group_advantages(score_group(rec, lambda s: 0.1 * s.generated_tokens))
        trees.append(rec.tree)
        advs.append(adv)
        branches += [Branch(tokens=np.array(t), trained=np.array(m), old_logprob=np.array(lp), execution=e + off,
                            advantage=float(adv[e])) for e, t, m, lp in bs]
        off += len(rec.executions)
    return trees, advs, branches


def grads_of(model, loss_fns):
    model.zero_grad()
    total = 0.0
    for fn in loss_fns:
        loss = fn()
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert abs(la - lb) <= 1e-10, f"{what}: loss {la} != {lb}"
    for n in ga:
        err = float((ga[n] - gb[n]).abs().max())
        assert err <= 1e-10, f"{what}: grad of {n} differs by {err}"


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_equals_naive_loss_and_grads(seed, normalization):
    """Packed loss/grads equal naive per-branch ones, unsplit, split, accumulated and merged by sign."""
    model = TinyLlama(CFG, np.random.default_rng(100 + seed), dtype=torch.float64)
    trees, advs, branches = scenario(seed)
    ref = grads_of(model, [lambda: naive_loss(model, branches, normalization, LOSS)])
    assert ref[0] != 0.0 and any(g.abs().sum() > 0 for g in ref[1].values()), "reference loss is trivial"
    deepest = max(b.tokens.shape[0] for b in branches)
    for bound in (10_000, deepest):
        batch = build_packs(trees, advs, PackConfig(max_tokens=bound, normalization=normalization))
        if bound == deepest:
            assert batch.stats.num_packs > 2, "the tight bound should split trees"
        got = grads_of(model, [lambda: packed_loss(model, batch.packs, LOSS)])
        assert_same(got, ref, f"bound {bound}")
        k = len(batch.packs) // 2
        micro = [batch.packs[:k], [], batch.packs[k:]]
        acc = grads_of(model, [lambda m=m: packed_loss(model, m, LOSS) for m in micro])
        assert_same(acc, ref, f"bound {bound}, accumulated over {len(micro)} micro-batches")
        merged = [Pack(input_ids=p.input_ids, position_ids=p.position_ids, leave=p.leave,
                       rows=merge_by_sign(p.rows)) for p in batch.packs]
        assert_same(grads_of(model, [lambda: packed_loss(model, merged, LOSS)]), ref, f"bound {bound}, merged")


def test_clipping_is_exercised():
    """The scenario has rows inside and outside the clip range, so the equality covers both branches."""
    model = TinyLlama(CFG, np.random.default_rng(100), dtype=torch.float64)
    _, _, branches = scenario(0)
    ratios = []
    with torch.no_grad():
        for b in branches:
            logp = torch.log_softmax(model(torch.as_tensor(b.tokens)[None], torch.arange(len(b.tokens))[None])[0], -1)
            for i in np.flatnonzero(b.trained[1:]) + 1:
                ratios.append(float(torch.exp(logp[i - 1, b.tokens[i]] - b.old_logprob[i])))
    r = np.array(ratios)
    inside = ((r > 1 - LOSS.clip_low) & (r < 1 + LOSS.clip_high)).sum()
    assert 0 < inside < len(r), f"{inside} of {len(r)} ratios inside the clip range"


def test_naive_branches_from_tree_match_generator():
    """Walking the tree's parent pointers gives the branches the generator saw."""
    trees, advs, branches = scenario(3, n_tasks=1)
    walked = branches_of(trees[0], advs[0])
    assert [b.tokens.tolist() for b in walked] == [b.tokens.tolist() for b in branches], "branch tokens"
    assert [b.execution for b in walked] == [b.execution for b in branches], "branch executions"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_dense_mask():
    """The FlexAttention BlockMask of a pack gives the dense-mask logits (forward; no CPU backward)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = TinyLlama(CFG, np.random.default_rng(5), dtype=torch.float64)
    trees, advs, branches = scenario(4)
    batch = build_packs(trees, advs, PackConfig(max_tokens=64))
    p = batch.packs[0]
    ids, pos = torch.as_tensor(p.input_ids)[None], torch.as_tensor(p.position_ids)[None]
    dm = dense_mask(p)
    assert dm.sum() > p.size and not dm.all(), "mask is neither diagonal nor full"
    with torch.no_grad():
        want = model(ids, pos, dm[None])
        got = model(ids, pos, block_mask(p, block_size=16))
    assert torch.allclose(got, want, atol=1e-10), "flex and dense masks disagree"


def test_mismatch_is_the_mean_abs_log_ratio_to_the_sampler():
    """packed_loss's `mismatch` accumulates (sum |log p - old log p|, rows) over the trained tokens, as a naive
    per-branch walk computes it, whether or not the trees are split into several packs."""
    model = TinyLlama(CFG, np.random.default_rng(100), dtype=torch.float64)
    trees, advs, branches = scenario(1)
    dev, n = 0.0, 0
    with torch.no_grad():
        for b in branches:
            logp = torch.log_softmax(model(torch.as_tensor(b.tokens)[None], torch.arange(len(b.tokens))[None])[0], -1)
            for i in np.flatnonzero(b.trained[1:]) + 1:
                dev += abs(float(logp[i - 1, b.tokens[i]]) - b.old_logprob[i])
                n += 1
    deepest = max(b.tokens.shape[0] for b in branches)
    for bound in (10_000, deepest):
        batch = build_packs(trees, advs, PackConfig(max_tokens=bound, normalization="token"))
        acc = torch.zeros(2, dtype=torch.float64)
        packed_loss(model, batch.packs, LOSS, mismatch=acc)
        assert int(acc[1]) == n, f"bound {bound}: {int(acc[1])} rows, naive {n}"
        assert abs(float(acc[0]) - dev) <= 1e-9 * max(1.0, dev), f"bound {bound}: {float(acc[0])} != {dev}"
