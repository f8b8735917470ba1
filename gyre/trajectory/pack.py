"""Packing trajectory trees into bounded training samples, with explicit loss gather lists (numpy only).

What it models: a batch of task trees becomes packs of at most `max_tokens` tokens. A pack holds one or
more *chunks*; a chunk is a contiguous DFS-preorder range [a, b) of one tree preceded by the ancestor path
of token a replayed as context, so every token in a pack sees all of its ancestors. Inside a pack the
position id is the token's depth and attention is ancestor-or-self: with enter = the pack index,
k may be attended by q iff enter[k] <= enter[q] < leave[k].

Cut points: from chunk start a the chunk may reach r = a + max_tokens - depth(a); among the starts of
unbranched runs in (a, r] (and r itself) the cut with the smallest depth (= replayed context of the next
chunk) wins, ties going to the later cut. Chunks are then placed into packs first-fit decreasing.

Loss rows: the naive expansion trains, on every branch, each policy token of the branch that has a
parent. Here each such (token, branch) pair is one row: prediction index (the pack index of the token's
parent), target token, old log-prob, advantage and execution of the branch, and a normalization weight
so that sum(weight * term) over all packs of the batch is the naive loss ("token": 1 / total rows;
"sequence": 1 / (executions * rows of the row's execution)). Duplicates are counted, as in the naive one.

Simplifications: children are visited in insertion order; a context deeper than the bound is an error
(exact attention needs every ancestor in the pack); packs are not padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.tree import Preorder, TokenTree

NORMALIZATIONS = ("token", "sequence")


@dataclass(kw_only=True, frozen=True)
class PackConfig:
    """Bound on tokens per pack and the loss normalization ("token" or "sequence")."""

    max_tokens: int = 32768
    normalization: str = "token"

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"PackConfig.max_tokens must be >= 2, got {self.max_tokens}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"PackConfig.normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")


@dataclass(kw_only=True, frozen=True)
class LossRows:
    """Loss gather list of one pack: one entry per (trained token, branch through it) or merged group."""

    pred: np.ndarray  # int64 pack index whose logits predict the target
    target: np.ndarray  # int64 target token id
    old_logprob: np.ndarray  # float64
    advantage: np.ndarray  # float64
    execution: np.ndarray  # int64 batch-global execution index (-1 after merging)
    branch: np.ndarray  # int64 batch-global branch index (-1 after merging)
    weight: np.ndarray  # float64 normalization weight

    def __len__(self) -> int:
        return int(self.pred.shape[0])


@dataclass(kw_only=True, frozen=True)
class Pack:
    """One training sample: tokens in pack order, position ids (= depth) and subtree ends."""

    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T]
    leave: np.ndarray  # int64 [T]: k is an ancestor-or-self of q iff k <= q < leave[k]
    rows: LossRows

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def ancestors(self, q: int) -> np.ndarray:
        """Pack indices of the ancestors-or-self of q, root first."""
        k = np.arange(q + 1)
        return k[self.leave[: q + 1] > q]


@dataclass(kw_only=True, frozen=True)
class PackStats:
    """Token accounting of one batch."""

    unique_tokens: int  # tokens stored in the trees
    naive_tokens: int  # every branch in full
    packed_tokens: int  # tokens in all packs (context replays included)
    num_packs: int
    loss_rows: int  # (trained token, branch) pairs = naive trained tokens

    @property
    def duplication_overhead(self) -> float:
        return self.packed_tokens / max(self.unique_tokens, 1) - 1.0

    @property
    def sharing(self) -> float:
        return self.naive_tokens / max(self.unique_tokens, 1)


@dataclass(kw_only=True, frozen=True)
class PackedBatch:
    packs: list[Pack]
    stats: PackStats
    branch_pack: np.ndarray  # pack of each branch's leaf (batch-global branch order: tree by tree)
    branch_index: np.ndarray  # pack index of each branch's leaf
    branch_execution: np.ndarray  # batch-global execution of each branch


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorized."""
    keep = lens > 0
    starts, lens = starts[keep].astype(np.int64), lens[keep].astype(np.int64)
    if starts.shape[0] == 0:
        return np.zeros(0, np.int64)
    step = np.ones(int(lens.sum()), np.int64)
    heads = np.cumsum(lens) - lens
    step[0] = starts[0]
    step[heads[1:]] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
    return np.cumsum(step)


def _choose_cuts(pre: Preorder, offset: int, max_tokens: int) -> list[int]:
    """Chunk starts (global preorder indices) for one tree."""
    depth, runs, n = pre.depth, pre.run_start, pre.size
    cuts, a = [], 0
    while a < n:
        cuts.append(a + offset)
        r = a + max_tokens - int(depth[a])
        if r >= n:
            break
        lo, hi = np.searchsorted(runs, a, "right"), np.searchsorted(runs, r, "right")
        best, best_depth = r, int(depth[r])
        if hi > lo:
            cand = runs[lo:hi]
            cd = depth[cand]
            j = hi - lo - 1 - int(np.argmin(cd[::-1]))  # smallest depth, latest on ties
            if cd[j] < best_depth:
                best = int(cand[j])
        a = best
    return cuts


def _first_fit_decreasing(sizes: np.ndarray, cap: int) -> np.ndarray:
    """Pack index of each item; items sorted by size (stable), each into the first pack with room."""
    room: list[int] = []
    out = np.empty(sizes.shape[0], np.int64)
    for i in np.argsort(-sizes, kind="stable").tolist():
        s = int(sizes[i])
        for p, free in enumerate(room):
            if free >= s:
                room[p] -= s
                out[i] = p
                break
        else:
            room.append(cap - s)
            out[i] = len(room) - 1
    return out


def build_packs(trees: list[TokenTree | Preorder], advantages: list, config: PackConfig) -> PackedBatch:
    """Pack a batch of task trees; `advantages[i][e]` is the advantage of execution e of tree i."""
    if len(trees) != len(advantages):
        raise ValueError(f"got {len(trees)} trees but {len(advantages)} advantage arrays")
    pres = [t.preorder() if isinstance(t, TokenTree) else t for t in trees]
    B = config.max_tokens
    # ---- concatenate trees into batch-global arrays ----
    sizes = np.array([p.size for p in pres], np.int64)
    toff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    cat = lambda f: np.concatenate([getattr(p, f) for p in pres]) if pres else np.zeros(0)  # noqa: E731
    tok, depth = cat("tokens").astype(np.int64), cat("depth").astype(np.int64)
    trained, logprob = cat("trained").astype(bool), cat("logprob").astype(np.float64)
    shift = np.repeat(toff[:-1], sizes)
    parent = cat("parent").astype(np.int64)
    parent = np.where(parent >= 0, parent + shift, -1)
    leave = cat("leave").astype(np.int64) + shift
    run_start = np.concatenate([p.run_start + o for p, o in zip(pres, toff)]) if pres else np.zeros(0, np.int64)
    n_exec = []
    for i, (p, adv) in enumerate(zip(pres, advantages)):
        adv = np.asarray(adv, np.float64).reshape(-1)
        if p.branch_execution.size and p.branch_execution.max() >= adv.shape[0]:
            raise ValueError(f"tree {i}: branch of execution {p.branch_execution.max()} has no advantage "
                             f"({adv.shape[0]} given)")
        n_exec.append(adv.shape[0])
    eoff = np.concatenate([[0], np.cumsum(n_exec)]).astype(np.int64)
    adv_all = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in advantages]) if pres else np.zeros(0)
    b_leaf = np.concatenate([p.branch_leaf + o for p, o in zip(pres, toff)]) if pres else np.zeros(0, np.int64)
    b_exec = np.concatenate([p.branch_execution + o for p, o in zip(pres, eoff)]) if pres else np.zeros(0, np.int64)
    b_leaf, b_exec = b_leaf.astype(np.int64), b_exec.astype(np.int64)
    if depth.size and int(depth.max()) + 1 > B:
        i = int(np.searchsorted(toff, int(np.argmax(depth)), "right") - 1)
        raise ValueError(f"tree {i} has a context of {int(depth.max()) + 1} tokens, more than max_tokens={B}")

    # ---- chunks and packs ----
    ca = np.array([c for i, p in enumerate(pres) for c in _choose_cuts(p, int(toff[i]), B)], np.int64)
    cb = np.append(ca[1:], toff[-1]) if ca.size else ca
    tree_end = toff[np.searchsorted(toff, ca, "right")] if ca.size else ca
    cb = np.minimum(cb, tree_end)
    cctx = depth[ca]
    csize = cctx + cb - ca
    cpack = _first_fit_decreasing(csize, B)
    corder = np.lexsort((ca, cpack))  # chunks in pack order
    n_packs = int(cpack.max()) + 1 if ca.size else 0
    coff = np.empty(ca.shape[0], np.int64)  # chunk's offset inside its pack
    sizes_sorted = csize[corder]
    pack_first = np.searchsorted(cpack[corder], np.arange(n_packs))
    ends = np.cumsum(sizes_sorted)
    coff[corder] = ends - sizes_sorted - np.repeat((ends - sizes_sorted)[pack_first], np.diff(np.append(pack_first, corder.shape[0])))
    pack_len = np.bincount(cpack, weights=csize, minlength=n_packs).astype(np.int64)

    # ---- token source of every pack position: replayed ancestor path, then the range ----
    p_starts, p_lens = [], []
    for c in corder.tolist():
        pieces = []
        x = int(parent[ca[c]])
        while x >= 0:
            s = int(run_start[np.searchsorted(run_start, x, "right") - 1])
            pieces.append((s, x - s + 1))
            x = int(parent[s])
        for s, ln in reversed(pieces):
            p_starts.append(s)
            p_lens.append(ln)
        p_starts.append(int(ca[c]))
        p_lens.append(int(cb[c] - ca[c]))
    src = concat_ranges(np.array(p_starts, np.int64), np.array(p_lens, np.int64))
    chunk_of_pos = np.repeat(corder, csize[corder])
    local_leave = (coff + cctx - ca)[chunk_of_pos] + np.minimum(leave[src], cb[chunk_of_pos])
    ids, pos_ids = tok[src], depth[src]

    # ---- loss rows: one per (trained token with a parent, branch through it) ----
    tgt = np.flatnonzero(trained & (parent >= 0))
    border = np.argsort(b_leaf, kind="stable")
    bl_sorted = b_leaf[border]
    lo = np.searchsorted(bl_sorted, tgt, "left")
    cnt = np.searchsorted(bl_sorted, leave[tgt], "left") - lo
    keep = cnt > 0
    tgt, lo, cnt = tgt[keep], lo[keep], cnt[keep]
    tc = np.searchsorted(ca, tgt, "right") - 1
    par_t = parent[tgt]
    pred_t = coff[tc] + np.where(par_t >= ca[tc], cctx[tc] + par_t - ca[tc], depth[par_t])
    branch = border[concat_ranges(lo, cnt)]
    row_pack = np.repeat(cpack[tc], cnt)
    execution = b_exec[branch]
    n_rows = int(branch.shape[0])
    if config.normalization == "token":
        weight = np.full(n_rows, 1.0 / max(n_rows, 1))
    else:
        per_exec = np.bincount(execution, minlength=int(eoff[-1])).astype(np.float64)
        n_active = int((per_exec > 0).sum())
        weight = 1.0 / (n_active * per_exec[execution]) if n_rows else np.zeros(0)
    rows_all = dict(
        pred=np.repeat(pred_t, cnt), target=np.repeat(tok[tgt], cnt), old_logprob=np.repeat(logprob[tgt], cnt),
        advantage=adv_all[execution], execution=execution, branch=branch, weight=weight,
    )
    rorder = np.argsort(row_pack, kind="stable")
    rbounds = np.searchsorted(row_pack[rorder], np.arange(n_packs + 1))
    rows_sorted = {k: v[rorder] for k, v in rows_all.items()}

    pbounds = np.concatenate([[0], np.cumsum(pack_len)])
    packs = []
    for p in range(n_packs):
        s, e = int(pbounds[p]), int(pbounds[p + 1])
        rs, re_ = int(rbounds[p]), int(rbounds[p + 1])
        packs.append(Pack(
            input_ids=ids[s:e], position_ids=pos_ids[s:e], leave=local_leave[s:e],
            rows=LossRows(**{k: v[rs:re_] for k, v in rows_sorted.items()}),
        ))
    lc = np.searchsorted(ca, b_leaf, "right") - 1 if b_leaf.size else b_leaf
    stats = PackStats(
        unique_tokens=int(tok.shape[0]), naive_tokens=int((depth[b_leaf] + 1).sum()) if b_leaf.size else 0,
        packed_tokens=int(pack_len.sum()), num_packs=n_packs, loss_rows=n_rows,
    )
    return PackedBatch(
        packs=packs, stats=stats, branch_pack=cpack[lc] if b_leaf.size else b_leaf,
        branch_index=(coff + cctx - ca)[lc] + b_leaf if b_leaf.size else b_leaf, branch_execution=b_exec,
    )


def merge_by_sign(rows: LossRows) -> LossRows:
    """Merge rows with the same (pred, target, old log-prob, advantage sign) into one with weight 1.

    The clipped PPO term of a row is -w*A*min(r, clip(r)) if A > 0 and -w*A*max(r, clip(r)) if A < 0, so
    rows sharing a ratio and a sign add up exactly to one row with advantage sum(w*A).
    """
    coef = rows.weight * rows.advantage
    sign = np.sign(coef)
    keep = sign != 0
    pred, tgt, olp, coef, sign = rows.pred[keep], rows.target[keep], rows.old_logprob[keep], coef[keep], sign[keep]
    order = np.lexsort((sign, olp, tgt, pred))
    pred, tgt, olp, coef, sign = pred[order], tgt[order], olp[order], coef[order], sign[order]
    if pred.shape[0] == 0:
        z = np.zeros(0, np.int64)
        return LossRows(pred=z, target=z, old_logprob=np.zeros(0), advantage=np.zeros(0), execution=z,
                        branch=z, weight=np.zeros(0))
    new = np.ones(pred.shape[0], bool)
    new[1:] = (pred[1:] != pred[:-1]) | (tgt[1:] != tgt[:-1]) | (olp[1:] != olp[:-1]) | (sign[1:] != sign[:-1])
    heads = np.flatnonzero(new)
    m = heads.shape[0]
    return LossRows(
        pred=pred[heads], target=tgt[heads], old_logprob=olp[heads], advantage=np.add.reduceat(coef, heads),
        execution=np.full(m, -1, np.int64), branch=np.full(m, -1, np.int64), weight=np.ones(m),
    )
