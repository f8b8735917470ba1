"""The FlexAttention block mask of a tree pack, built from its `leave` ranges: the same block classes as the
dense [S, S] mask reduced block by block, the same attention inside partial blocks, the naive loss and
gradients through it, and no [S, S] tensor while it is built (a 64K-token pack on CPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the random scenario generators live beside this file
from test_trajectory_loss import CFG, LOSS, assert_same, grads_of, scenario  # noqa: E402

import gyre.trajectory.torch_ops as ops  # noqa: E402
from gyre.real.nn.model import TinyLlama, TinyLlamaConfig  # noqa: E402
from gyre.trajectory import PackConfig, TaskRecorder, build_packs  # noqa: E402
from gyre.trajectory.loss_rows import LossRows  # noqa: E402
from gyre.trajectory.pack import Pack  # noqa: E402

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


def random_tree_leave(rng: np.random.Generator, n: int, branch_p: float = 0.15) -> np.ndarray:
    """`leave` of a random forest of n tokens in DFS preorder: each token is the child of the innermost open
    token; before it, with probability branch_p, 1-3 open tokens are closed (a branch point, or a new root when
    all are closed). Built by walking a stack, not from the packer."""
    leave = np.full(n, n, np.int64)
    stack: list[int] = []
    for i in range(n):
        if rng.random() < branch_p:
            for _ in range(min(int(rng.integers(1, 4)), len(stack))):
                leave[stack.pop()] = i
        stack.append(i)
    return leave


def bare_pack(leave: np.ndarray) -> Pack:
    n = leave.shape[0]
    z = np.zeros(0, np.int64)
    return Pack(input_ids=np.zeros(n, np.int64), position_ids=np.zeros(n, np.int64), leave=leave,
                rows=LossRows(pred=z, target=z, old_logprob=np.zeros(0), advantage=np.zeros(0), execution=z,
                              branch=z, weight=np.zeros(0)))


def dense_block_classes(pack: Pack, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """(partial, full) [nb, nb] from the dense mask: zero-padded to whole blocks, allowed pairs counted per block;
    full = all bs^2 pairs allowed, partial = some but not all."""
    s = pack.size
    nb = -(-s // bs)
    m = np.zeros((nb * bs, nb * bs), bool)
    m[:s, :s] = ops.dense_mask(pack).numpy()
    count = m.reshape(nb, bs, nb, bs).sum(axis=(1, 3))
    return (count > 0) & (count < bs * bs), count == bs * bs


def listed(num: torch.Tensor, idx: torch.Tensor) -> np.ndarray:
    """Bool [n, m] grid of the blocks a BlockMask's (num_blocks [1, 1, n], indices [1, 1, n, m]) lists: row r's
    first num[r] indices."""
    num, idx = num[0, 0].numpy(), idx[0, 0].numpy()
    rows, slot = np.nonzero(np.arange(idx.shape[1])[None, :] < num[:, None])
    grid = np.zeros(idx.shape, bool)
    grid[rows, idx[rows, slot]] = True
    assert grid.sum() == num.sum(), "a block listed twice in one row"
    return grid


def flex_dense(bm) -> torch.Tensor:
    """Bool [S, S] that FlexAttention attends under `bm`: True in its full blocks, its mask_mod in its partial
    blocks, False elsewhere (the kernel's rule, written out for a CPU reference)."""
    bq, bk = bm.BLOCK_SIZE
    s_q, s_k = bm.seq_lengths
    out = torch.zeros(bm.kv_num_blocks.shape[-1] * bq, bm.kv_indices.shape[-1] * bk, dtype=torch.bool)
    zero = torch.zeros((), dtype=torch.int64)
    for r in range(bm.kv_num_blocks.shape[-1]):
        q = torch.arange(r * bq, (r + 1) * bq)
        for c in bm.full_kv_indices[0, 0, r, : int(bm.full_kv_num_blocks[0, 0, r])].tolist():
            out[r * bq:(r + 1) * bq, c * bk:(c + 1) * bk] = True
        for c in bm.kv_indices[0, 0, r, : int(bm.kv_num_blocks[0, 0, r])].tolist():
            k = torch.arange(c * bk, (c + 1) * bk)
            out[r * bq:(r + 1) * bq, c * bk:(c + 1) * bk] = bm.mask_mod(zero, zero, q[:, None], k[None, :])
    return out[:s_q, :s_k]


def packs_for_tests() -> list[tuple[str, Pack]]:
    """Random stack-built forests of several sizes, and the packer's own packs of random GRPO groups (several
    concatenated: trees side by side)."""
    rng = np.random.default_rng(7)
    out = [(f"forest-{n}", bare_pack(random_tree_leave(rng, n, p))) for n, p in ((1, 0.2), (37, 0.3), (200, 0.02),
                                                                                 (333, 0.15), (517, 0.05))]
    trees, advs, _ = scenario(2, n_tasks=3)
    batch = build_packs(trees, advs, PackConfig(max_tokens=48))
    out.append(("packer-one", batch.packs[0]))
    out.append(("packer-all", ops.concat_packs(batch.packs)))
    return out


@pytest.mark.parametrize("bs", [1, 3, 8, 16, 128])
def test_tree_blocks_equal_the_dense_masks_blocks(bs):
    """Block classes (empty / partial / full) from `leave` alone equal those of the dense mask reduced block by
    block, on random forests and packer packs whose sizes are not multiples of the block size; the BlockMask
    lists exactly those blocks, per query row and per key column."""
    seen_partial = seen_full = 0
    for name, pack in packs_for_tests():
        want_partial, want_full = dense_block_classes(pack, bs)
        partial, full = ops.tree_blocks(torch.as_tensor(pack.leave), bs)
        assert np.array_equal(partial.numpy(), want_partial), f"{name}, block {bs}: partial blocks differ"
        assert np.array_equal(full.numpy(), want_full), f"{name}, block {bs}: full blocks differ"
        bm = ops.block_mask(pack, block_size=bs)
        assert bm.seq_lengths == (pack.size, pack.size), f"{name}: seq_lengths {bm.seq_lengths}"
        for what, num, idx, want in (("kv partial", bm.kv_num_blocks, bm.kv_indices, want_partial),
                                     ("kv full", bm.full_kv_num_blocks, bm.full_kv_indices, want_full),
                                     ("q partial", bm.q_num_blocks, bm.q_indices, want_partial.T),
                                     ("q full", bm.full_q_num_blocks, bm.full_q_indices, want_full.T)):
            assert np.array_equal(listed(num, idx), want), f"{name}, block {bs}: BlockMask's {what} blocks differ"
        seen_partial += int(want_partial.sum())
        seen_full += int(want_full.sum())
    assert seen_partial > 0 or bs == 1, f"block {bs}: no partial block in any pack"
    assert seen_full > 0 or bs == 128, f"block {bs}: no full block in any pack"


@pytest.mark.parametrize("bs", [1, 5, 16])
def test_block_mask_attends_exactly_the_ancestors(bs):
    """Full blocks whole, the mask_mod inside partial blocks and nothing elsewhere give the dense
    ancestor-or-self mask; a forest whose last block is cut by S included."""
    for name, pack in packs_for_tests():
        got = flex_dense(ops.block_mask(pack, block_size=bs))
        assert torch.equal(got, ops.dense_mask(pack)), f"{name}, block {bs}: attended pairs differ"


@pytest.mark.parametrize("bs", [4, 16])
def test_loss_and_grads_under_the_block_mask_equal_naive(bs, monkeypatch):
    """The packed loss and gradients with attention restricted as the BlockMask restricts it (flex_dense: no
    flex backward on a CPU) equal the naive per-branch ones, packs split and concatenated."""
    model = TinyLlama(CFG, np.random.default_rng(11), dtype=torch.float64)
    trees, advs, branches = scenario(0)
    ref = grads_of(model, [lambda: ops.naive_loss(model, branches, "sequence", LOSS)])
    deepest = max(b.tokens.shape[0] for b in branches)
    batch = build_packs(trees, advs, PackConfig(max_tokens=deepest, normalization="sequence"))
    assert batch.stats.num_packs > 2, "the tight bound should split trees"
    monkeypatch.setattr(ops, "dense_mask", lambda pack, device="cpu": flex_dense(ops.block_mask(pack, device, bs)))
    got = grads_of(model, [lambda: ops.packed_loss(model, batch.packs, LOSS, micro_tokens=3 * deepest)])
    assert_same(got, ref, f"block {bs}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("bs", [4, 16])
def test_flex_forward_with_the_block_mask_equals_the_dense_mask(bs):
    """FlexAttention (eager, CPU forward) under the tree-built BlockMask gives the SDPA logits of the dense mask,
    on concatenated packs of 3 trees."""
    model = TinyLlama(CFG, np.random.default_rng(5), dtype=torch.float64)
    trees, advs, _ = scenario(4, n_tasks=3)
    p = ops.concat_packs(build_packs(trees, advs, PackConfig(max_tokens=64)).packs)
    assert p.size % bs != 0 or p.size % 16 != 0, "a size that some block size does not divide"
    ids, pos = torch.as_tensor(p.input_ids)[None], torch.as_tensor(p.position_ids)[None]
    with torch.no_grad():
        want = model(ids, pos, ops.dense_mask(p)[None])
        got = model(ids, pos, ops.block_mask(p, block_size=bs))
    assert torch.allclose(got, want, atol=1e-10), f"block {bs}: flex and dense masks disagree"


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def test_a_64k_block_mask_builds_without_an_s_squared_tensor():
    """Building the BlockMask of a 65,536-token branching pack creates no tensor above (S / 128)^2 + S / 128
    elements (the block grid and BlockMask's own q-side transpose), 16,000x under S^2; the dense mask of a
    4,096-token pack, watched the same way, does reach S^2 (the watch sees what it should)."""
    s, bs = 65536, 128
    pack = bare_pack(random_tree_leave(np.random.default_rng(3), s, 0.01))
    with _LargestTensor() as watch:
        bm = ops.block_mask(pack, block_size=bs)
    nb = s // bs
    assert watch.largest <= nb * (nb + 1), f"{watch.largest} elements from {watch.op} (S^2 = {s * s})"
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        n = getattr(bm, name).numel()
        assert n <= nb * nb, f"BlockMask.{name} holds {n} elements"
    assert int(bm.full_kv_num_blocks.sum()) > 0 and int(bm.kv_num_blocks.sum()) > 0, "full and partial blocks"
    with _LargestTensor() as watch:
        ops.dense_mask(bare_pack(random_tree_leave(np.random.default_rng(3), 4096)))
    assert watch.largest == 4096 * 4096, f"the watch saw {watch.largest} elements for the dense mask"


def shared_prefix_group(rng: np.random.Generator):
    """One GRPO group over a 300-token prompt: 4 executions of 150 model tokens, a 40-token tool reply, a retry
    from the first turn and 100 more tokens (1,460 packed tokens: full and partial 128-blocks)."""
    rec = TaskRecorder("t", rng.integers(0, 3, 300))
    for _ in range(4):
        ex = rec.start()
        mark = ex.append_model(rng.integers(0, 3, 150), -rng.exponential(0.5, 150), 0)
        ex.append_env(rng.integers(0, 3, 40))
        ex.retry(mark)
        ex.append_model(rng.integers(0, 3, 100), -rng.exponential(0.5, 100), 0)
        ex.finish(float(rng.random()))
    return rec, rng.normal(size=len(rec.executions))


@pytest.mark.gpu
def test_flex_loss_and_grads_equal_naive_on_cuda():
    """On CUDA, the packed loss through FlexAttention with the tree-built BlockMask (compiled flex, forward and
    backward, 128-blocks full and partial) equals the naive loss to 1e-5 and its gradients to 1e-4 relative in fp32
    (a wrong block moves them by O(1); fp32 SDPA on a CPU is at 2e-6 here)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = TinyLlamaConfig(vocab_size=3, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, init_std=0.4)
    model = TinyLlama(cfg, np.random.default_rng(12), dtype=torch.float32).cuda()  # head dim 16, as flex wants
    rec, adv = shared_prefix_group(np.random.default_rng(0))
    batch = build_packs([rec.tree], [adv], PackConfig(max_tokens=4096, normalization="token"))
    partial, full = ops.tree_blocks(torch.as_tensor(batch.packs[0].leave), 128)
    assert len(batch.packs) == 1 and int(partial.sum()) > 0 and int(full.sum()) > 0, "one pack, both block kinds"
    ref = grads_of(model, [lambda: ops.naive_loss(model, ops.branches_of(rec.tree, adv), "token", LOSS,
                                                  device="cuda")])
    got = grads_of(model, [lambda: ops.packed_loss(model, batch.packs, LOSS, use_flex=True, device="cuda")])
    assert abs(got[0] - ref[0]) <= 1e-5 * max(1.0, abs(ref[0])), f"loss {got[0]} != {ref[0]}"
    for n, g in ref[1].items():
        err = float((got[1][n] - g).norm() / max(float(g.norm()), 1e-12))
        assert err <= 1e-4, f"grad of {n}: relative error {err}"
