"""Packing trajectory trees into bounded training samples, with explicit loss gather lists (numpy only).

What it models: a batch of task trees becomes packs of at most `max_tokens` tokens. A pack holds one or
more *chunks*; a chunk is a contiguous DFS-preorder range [a, b) of one tree preceded by the ancestor path
of token a replayed as context, so every token in a pack sees all of its ancestors. Inside a pack the
position id is the token's depth and attention is ancestor-or-self: with enter = the pack index,
k may be attended by q iff enter[k] <= enter[q] < leave[k].

Cut points: a chunk starting at a may reach a + max_tokens - depth(a); the cuts minimize the total
replayed context (sum of the chunk starts' depths) exactly, by dynamic programming over the starts of
unbranched runs (see `_choose_cuts`). Chunks are then placed into packs first-fit decreasing.

Loss rows: the naive expansion trains, on every branch, each policy token of the branch that has a
parent. Here each such (token, branch) pair is one row: prediction index (the pack index of the token's
parent), target token, old log-prob, advantage and execution of the branch, and a normalization weight
so that sum(weight * term) over all packs of the batch is the naive loss ("token": 1 / total rows;
"sequence": 1 / (executions * rows of the row's execution)). Duplicates are counted, as in the naive one.
The rows' layout, and their merge by advantage sign, are gyre.trajectory.loss_rows's.

Sampling (`PackConfig.sampling`, gyre.trajectory.sample): "exact" packs and trains every branch as above;
"roles" first draws each execution's paths (role-bounded, at most j_max, from the Generator passed in), cuts
each tree down to the tokens on the drawn paths (`restrict`), and keeps one row per (trained token,
execution): the row of the earliest drawn path through it, so a masked prefix trains once. The weights are
then those of the naive loss over the drawn paths with each execution's masked tokens counted once
("sequence": the mean over an execution's trainable tokens first, then the mean across executions, the
paper's rule). Branches of the batch are then the drawn paths (`PackedBatch.branch_source`: which branch
of its tree each was).

The steps of `build_packs` (cut, weight, place, assemble, locate leaves) share one chunk layout, so they
live in this one module.

Simplifications: children are visited in insertion order; a context deeper than the bound is an error
(exact attention needs every ancestor in the pack); packs are not padded; tokens on no closed branch (an
execution still running) are packed but never trained; cuts minimize replayed tokens, not pack count.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from gyre.trajectory.loss_rows import LossRows
from gyre.trajectory.sample import SamplingConfig, preorder_segments, restrict, sample_branches
from gyre.trajectory.tree import Preorder, TokenTree

NORMALIZATIONS = ("token", "sequence")


@dataclass(kw_only=True, frozen=True)
class PackConfig:
    """Bound on tokens per pack, the loss normalization ("token" or "sequence") and which paths train."""

    max_tokens: int = 32768
    normalization: str = "token"
    sampling: SamplingConfig = SamplingConfig()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"PackConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"PackConfig.normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")


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
    loss_rows: int  # (trained token, branch) pairs = naive trained tokens (sampled: (token, execution) pairs)
    kept_tokens: int = -1  # tokens on the trained paths (exact: every token, = unique_tokens)
    paths: int = 0  # branches trained (exact: every branch)
    # sampled only: what exact training of the same batch trains (the trees of the executions that train, every
    # branch), and the attention-context sums (per token, the ancestors-or-self it attends to: depth + 1) of both
    exact_tokens: int = -1
    kept_attn: int = 0
    exact_attn: int = 0

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
    branch_source: np.ndarray | None = None  # sampled: each branch's index among its tree's (kept) branches


def _choose_cuts(pre: Preorder, max_tokens: int) -> list[int]:
    """Chunk starts (preorder indices) of one tree minimizing the replayed context, sum of depth(start).

    A chunk [a, b) fits iff b <= reach(a) = a + max_tokens - depth(a). Inside an unbranched run depth grows
    one per token, so every position of a run has its run start's reach; moving a cut back to its run start
    is never worse, and two cuts in one run merge. Hence an optimal set of cuts uses run starts only, and
    f(k) = depth(s_k) + min{f(j) : j < k, reach(s_j) >= s_k} is solved left to right with a lazy heap
    (a start whose reach is passed never becomes valid again). Ties go to the earlier predecessor.
    """
    n = pre.size
    if n == 0:  # nothing left of the tree (every execution left training)
        return []
    starts = pre.run_start.tolist()
    reach = (pre.run_start + max_tokens - pre.depth[pre.run_start]).tolist()
    depth = pre.depth[pre.run_start].tolist()
    f = [0] * len(starts)
    prev = [-1] * len(starts)
    heap: list[tuple[int, int]] = [(0, 0)]
    for k in range(1, len(starts) + 1):
        target = starts[k] if k < len(starts) else n
        while reach[heap[0][1]] < target:  # never empty: the previous start always reaches this one
            heapq.heappop(heap)
        best, j = heap[0]
        if k == len(starts):
            end = j
            break
        f[k], prev[k] = best + depth[k], j
        heapq.heappush(heap, (f[k], k))
    else:
        end = 0
    cuts = []
    while end >= 0:
        cuts.append(starts[end])
        end = prev[end]
    return cuts[::-1]


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


@dataclass
class _TreeRows:
    """Loss rows of one tree in target (preorder) order, and where each chunk's rows start."""

    pred: np.ndarray  # prediction index inside the chunk (pack offset added at assembly)
    target: np.ndarray
    old_logprob: np.ndarray
    execution: np.ndarray  # batch-global
    branch: np.ndarray  # batch-global
    chunk_bounds: np.ndarray  # row range of chunk c: chunk_bounds[c] .. chunk_bounds[c + 1]


def _tree_rows(pre: Preorder, ca: np.ndarray, eoff: int, boff: int, once: bool = False) -> _TreeRows:
    """One row per (trained token with a parent, branch through it), built per *segment*: a maximal piece
    of an unbranched run holding no branch leaf but its last token and no chunk start but its first. All
    tokens of a segment have the same branches through them (leaves in [start, leave[start])), the same
    chunk, and their parent is the previous token, except possibly for the first one. `once`: one row per
    (token, execution), the lowest-numbered branch of the execution through it (sampled mode)."""
    n = pre.size
    border = np.argsort(pre.branch_leaf, kind="stable")
    bl_sorted = pre.branch_leaf[border]
    bounds = np.unique(np.concatenate([pre.run_start, pre.branch_leaf + 1, ca, [n]]))
    seg_s, seg_e = bounds[:-1], bounds[1:]
    lo = np.searchsorted(bl_sorted, seg_s, "left").tolist()
    hi = np.searchsorted(bl_sorted, pre.leave[seg_s], "left").tolist()
    seg_chunk = (np.searchsorted(ca, seg_s, "right") - 1).tolist()
    ctx = pre.depth[ca].tolist()
    ca_l, exe = ca.tolist(), pre.branch_execution
    pred, target, olp, execution, branch = [], [], [], [], []
    counts, chunk_rows = [], np.zeros(ca.shape[0] + 1, np.int64)
    trained, parent, depth = pre.trained, pre.parent, pre.depth
    for k, (s, e) in enumerate(zip(seg_s.tolist(), seg_e.tolist())):
        if hi[k] == lo[k]:
            continue
        ts = np.flatnonzero(trained[s:e])
        if ts.shape[0] == 0:
            continue
        ts += s
        a, c = ca_l[seg_chunk[k]], ctx[seg_chunk[k]]
        pr = ts + (c - a - 1)
        if ts[0] == s:
            par = int(parent[s])
            if par < 0:
                ts, pr = ts[1:], pr[1:]
                if ts.shape[0] == 0:
                    continue
            else:
                pr[0] = c + par - a if par >= a else int(depth[par])
        tg, lp = pre.tokens[ts], pre.logprob[ts]
        m = ts.shape[0]
        through = border[lo[k] : hi[k]].tolist()
        if once:
            seen: set[int] = set()
            through = [b for b in sorted(through) if not (int(exe[b]) in seen or seen.add(int(exe[b])))]
        for b in through:
            pred.append(pr)
            target.append(tg)
            olp.append(lp)
            execution.append(np.full(m, int(exe[b]) + eoff, np.int64))
            branch.append(np.full(m, b + boff, np.int64))
            counts.append(m)
            chunk_rows[seg_chunk[k] + 1] += m
    return _TreeRows(
        pred=_cat(pred, np.int64), target=_cat(target, np.int64), old_logprob=_cat(olp, np.float64),
        execution=_cat(execution, np.int64), branch=_cat(branch, np.int64), chunk_bounds=np.cumsum(chunk_rows),
    )


def _cat(xs: list[np.ndarray], dtype) -> np.ndarray:
    """The arrays end to end (the one array itself when there is one; an empty one when there are none)."""
    if not xs:
        return np.zeros(0, dtype)
    return xs[0] if len(xs) == 1 else np.concatenate(xs)


def _cut_trees(pres: list[Preorder], advs: list[np.ndarray], B: int, eoff: np.ndarray, boff: np.ndarray,
               once: bool = False):
    """Step 1: check each tree against its advantages and the bound, choose its cuts, and build its loss rows.
    Returns (chunks as (tree, a, b), cut starts per tree, rows per tree)."""
    chunks: list[tuple[int, int, int]] = []
    cuts, rows = [], []
    for i, (p, adv) in enumerate(zip(pres, advs)):
        if p.branch_execution.size and p.branch_execution.max() >= adv.shape[0]:
            raise ValueError(f"tree {i}: branch of execution {p.branch_execution.max()} has no advantage "
                             f"({adv.shape[0]} given)")
        if p.size and int(p.depth.max()) + 1 > B:
            raise ValueError(f"tree {i} has a context of {int(p.depth.max()) + 1} tokens, more than max_tokens={B}")
        ca = np.asarray(_choose_cuts(p, B), np.int64)
        cuts.append(ca)
        chunks.extend((i, int(a), int(b)) for a, b in zip(ca.tolist(), np.append(ca[1:], p.size).tolist()))
        rows.append(_tree_rows(p, ca, int(eoff[i]), int(boff[i]), once))
    return chunks, cuts, rows


def _execution_weights(rows: list[_TreeRows], n_exec: int, n_rows: int, normalization: str) -> np.ndarray:
    """Step 2: each execution's loss weight, so the weighted sum over all packs is the naive loss."""
    if normalization == "token":
        return np.full(n_exec, 1.0 / max(n_rows, 1))
    per_exec = np.bincount(_cat([r.execution for r in rows], np.int64), minlength=n_exec).astype(np.float64)
    n_active = max(int((per_exec > 0).sum()), 1)
    return np.where(per_exec > 0, 1.0 / (n_active * np.maximum(per_exec, 1)), 0.0)


def _assemble_pack(members: list[int], chunks, pres, ctx, csize, rows, cuts_before, adv_all, exec_weight,
                   chunk_off) -> Pack:
    """Step 4: one pack from its chunks, each preceded by its ancestor path replayed one unbranched run at a
    time; records where each chunk starts in the pack (`chunk_off`)."""
    ids, pos, lv, parts = [], [], [], []
    off = 0
    for c in members:
        t, a, b = chunks[c]
        pre = pres[t]
        chunk_off[c] = off
        pieces = [(a, b)]
        x = int(pre.parent[a])
        while x >= 0:
            s = int(pre.run_start[np.searchsorted(pre.run_start, x, "right") - 1])
            pieces.append((s, x + 1))
            x = int(pre.parent[s])
        base = off + int(ctx[c]) - a
        for s, e in reversed(pieces):
            ids.append(pre.tokens[s:e])
            pos.append(pre.depth[s:e])
            lv.append(np.minimum(pre.leave[s:e], b) + base)
        k = c - int(cuts_before[t])
        r0, r1 = int(rows[t].chunk_bounds[k]), int(rows[t].chunk_bounds[k + 1])
        parts.append((rows[t], r0, r1, off))
        off += int(csize[c])
    execution = _cat([r.execution[r0:r1] for r, r0, r1, _ in parts], np.int64)
    return Pack(
        input_ids=_cat(ids, np.int64), position_ids=_cat(pos, np.int64), leave=_cat(lv, np.int64),
        rows=LossRows(
            pred=_cat([r.pred[r0:r1] + o if o else r.pred[r0:r1] for r, r0, r1, o in parts], np.int64),
            target=_cat([r.target[r0:r1] for r, r0, r1, _ in parts], np.int64),
            old_logprob=_cat([r.old_logprob[r0:r1] for r, r0, r1, _ in parts], np.float64),
            advantage=adv_all[execution], execution=execution,
            branch=_cat([r.branch[r0:r1] for r, r0, r1, _ in parts], np.int64),
            weight=exec_weight[execution],
        ),
    )


def _attn_ctx(pres: list[Preorder]) -> int:
    """Sum over the trees' tokens of the context each attends to in a tree's mask (its depth + 1)."""
    return sum(int(p.depth.sum()) + p.size for p in pres)


def build_packs(trees: list[TokenTree | Preorder], advantages: list, config: PackConfig,
                rng: np.random.Generator | None = None) -> PackedBatch:
    """Pack a batch of task trees; `advantages[i][e]` is the advantage of execution e of tree i (NaN: it left
    training, none of its branches is trained or packed); `rng` draws the paths of role-bounded sampling (needed
    then, unused by exact packing).

    Steps: (sampled: draw each tree's paths and cut it down to them;) cut every tree into chunks and build its
    loss rows; weight the rows; place the chunks into packs (first-fit decreasing by chunk size, context
    included); assemble each pack; record where each branch's leaf landed."""
    if len(trees) != len(advantages):
        raise ValueError(f"got {len(trees)} trees but {len(advantages)} advantage arrays")
    pres = [t.preorder() if isinstance(t, TokenTree) else t for t in trees]
    unique = sum(p.size for p in pres)
    advs = [np.asarray(a, np.float64).reshape(-1) for a in advantages]
    for i, (p, adv) in enumerate(zip(pres, advs)):  # a NaN advantage: the execution left training (credit.py)
        gone = np.isnan(adv)
        if gone.any() and p.branch_execution.size and p.branch_execution.max() < adv.shape[0]:
            pres[i] = restrict(p, np.flatnonzero(~gone[p.branch_execution]))
    sampled = config.sampling.sampled
    source = None
    # what exact training would train: counted only where sampling trains less (exact: the kept counts below)
    exact_tokens, exact_attn = (sum(p.size for p in pres), _attn_ctx(pres)) if sampled else (-1, 0)
    if sampled:
        if rng is None:
            raise ValueError("PackConfig.sampling.mode = 'roles' needs a numpy Generator (build_packs(..., rng=))")
        segs = [preorder_segments(p) for p in pres]
        drawn = [sample_branches(p, config.sampling, rng, sg) for p, sg in zip(pres, segs)]
        pres = [restrict(p, d, sg) for p, d, sg in zip(pres, drawn, segs)]
        source = _cat(drawn, np.int64)
    B = config.max_tokens
    eoff = np.concatenate([[0], np.cumsum([a.shape[0] for a in advs])]).astype(np.int64)
    boff = np.concatenate([[0], np.cumsum([p.branch_leaf.shape[0] for p in pres])]).astype(np.int64)
    adv_all = np.concatenate(advs) if advs else np.zeros(0)

    chunks, cuts, rows = _cut_trees(pres, advs, B, eoff, boff, once=sampled)
    n_rows = sum(int(r.pred.shape[0]) for r in rows)
    exec_weight = _execution_weights(rows, int(eoff[-1]), n_rows, config.normalization)

    # step 3: placement
    ctx = np.array([int(pres[t].depth[a]) for t, a, _ in chunks], np.int64)
    csize = ctx + np.array([b - a for _, a, b in chunks], np.int64)
    cpack = _first_fit_decreasing(csize, B)
    n_packs = int(cpack.max()) + 1 if chunks else 0
    members: list[list[int]] = [[] for _ in range(n_packs)]
    for c in np.lexsort((np.arange(len(chunks)), cpack)).tolist():
        members[cpack[c]].append(c)
    cuts_before = np.concatenate([[0], np.cumsum([len(c) for c in cuts])]).astype(np.int64)

    chunk_off = np.zeros(len(chunks), np.int64)
    packs = [_assemble_pack(members[p], chunks, pres, ctx, csize, rows, cuts_before, adv_all, exec_weight,
                            chunk_off) for p in range(n_packs)]

    # step 5: where each branch's leaf landed (for reconstruction and tests)
    b_pack, b_index, b_exec, naive = [], [], [], 0
    for t, pre in enumerate(pres):
        leaves = pre.branch_leaf
        lc = np.searchsorted(cuts[t], leaves, "right") - 1
        gc = lc + int(cuts_before[t])
        b_pack.append(cpack[gc])
        b_index.append(chunk_off[gc] + ctx[gc] + leaves - cuts[t][lc])
        b_exec.append(pre.branch_execution + eoff[t])
        naive += int((pre.depth[leaves] + 1).sum())
    stats = PackStats(
        unique_tokens=unique, naive_tokens=naive, packed_tokens=int(csize.sum()),
        num_packs=n_packs, loss_rows=n_rows, kept_tokens=sum(p.size for p in pres), paths=int(boff[-1]),
        exact_tokens=exact_tokens, kept_attn=_attn_ctx(pres) if sampled else 0, exact_attn=exact_attn,
    )
    return PackedBatch(packs=packs, stats=stats, branch_pack=_cat(b_pack, np.int64),
                       branch_index=_cat(b_index, np.int64), branch_execution=_cat(b_exec, np.int64),
                       branch_source=source)
