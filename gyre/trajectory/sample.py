"""Role-bounded path sampling: which root-to-leaf paths of an execution are trained (numpy only).

What it models (the trajectory processor of the system Gyre follows, ../shared/PAPER.md): an execution's
leaves are classed by role (gyre.trajectory.tree.ROLES), in the priority order `SamplingConfig.role_priority`
(default main > main-summary > sub-agent > sub-agent-summary). From the highest class that still has a leaf
with unmasked trainable tokens on its path, one leaf is drawn with probability proportional to those tokens;
its whole root-to-leaf path is then masked, so a prefix it shares with a later drawn path is trained once.
This repeats until no leaf has unmasked trainable tokens or `j_max` paths are drawn (None: uncapped).

The sampler works on a tree of *segments* (nodes holding a count of trainable tokens, each with a parent),
so one code serves the real backend's token trees (`preorder_segments`: maximal pieces of unbranched runs
holding no branch leaf but their last token) and the simulator's turn trees (gyre.workload.execution_tree).
`restrict` cuts a Preorder down to the tokens on chosen branches (what is packed and trained).

Choices the paper leaves open, made here: "trainable" tokens are the policy's tokens that have a parent
(what the loss can target); masking is per execution (the paper's trees are per execution; in a task tree
a policy token two executions share is trained once for each, with its own advantage); a draw takes one
`rng.random()` u and picks the first leaf of the class (in branch order) whose cumulative unmasked count
exceeds u x the class total; leaves of one execution are drawn before the next execution's, in execution
order, so a run is a pure function of the trees and the Generator's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.tree import ROLES, Preorder

MODES = ("exact", "roles")


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    """Which paths train: "exact" (every branch, today's packing) or "roles" (role-bounded sampling, at most
    `j_max` paths per execution, None or "uncapped": no cap; leaves classed in `role_priority` order, highest
    first)."""

    mode: str = "exact"
    j_max: int | None = 5
    role_priority: tuple[str, ...] = ROLES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SamplingConfig.mode must be one of {MODES}, got {self.mode!r}")
        j = self.j_max
        if j == "uncapped":  # a config file cannot write None
            object.__setattr__(self, "j_max", None)
            j = None
        if j is not None and (isinstance(j, bool) or not isinstance(j, int) or j < 1):
            raise ValueError(f"SamplingConfig.j_max must be an integer >= 1 (or None, 'uncapped': no cap), "
                             f"got {j!r}")
        prio = tuple(self.role_priority)
        bad = [r for r in prio if r not in ROLES]
        if bad:
            raise ValueError(f"SamplingConfig.role_priority: unknown role {bad[0]!r} (roles: {', '.join(ROLES)})")
        if sorted(prio) != sorted(ROLES):
            raise ValueError(f"SamplingConfig.role_priority must name each of {ROLES} once, got {prio}")
        object.__setattr__(self, "role_priority", prio)

    @property
    def sampled(self) -> bool:
        return self.mode == "roles"


def draw_paths(seg_parent: np.ndarray, seg_weight: np.ndarray, leaf_seg: np.ndarray, leaf_exec: np.ndarray,
               leaf_role: np.ndarray, config: SamplingConfig, rng: np.random.Generator) -> np.ndarray:
    """Indices of the drawn leaves, execution by execution (ascending), each execution's in draw order.

    seg_parent[s]: parent segment (-1: a root); seg_weight[s]: trainable tokens of s; leaf_seg[l]: the segment
    ending with leaf l's last token; leaf_exec[l], leaf_role[l] (index into ROLES): its execution and role."""
    rank_of_role = np.array([config.role_priority.index(r) for r in ROLES], np.int64)
    cap = config.j_max if config.j_max is not None else len(leaf_seg)
    parent = seg_parent.tolist()
    weight = np.asarray(seg_weight, np.int64)
    masked = np.zeros(weight.shape[0], bool)
    out: list[int] = []
    for e in np.unique(leaf_exec).tolist():
        leaves = np.flatnonzero(leaf_exec == e)
        paths = []
        for s in leaf_seg[leaves].tolist():
            p = []
            while s >= 0:
                p.append(s)
                s = parent[s]
            paths.append(np.asarray(p, np.int64))
        rank = rank_of_role[leaf_role[leaves]]
        left = np.array([int(weight[p].sum()) for p in paths], np.int64)
        touched = []
        for _ in range(cap):
            live = left > 0
            if not live.any():
                break
            pool = np.flatnonzero(live & (rank == rank[live].min()))
            cum = np.cumsum(left[pool])
            k = int(pool[int(np.searchsorted(cum, rng.random() * cum[-1], "right"))])
            out.append(int(leaves[k]))
            masked[paths[k]] = True
            touched.append(paths[k])
            left = np.array([int(weight[p][~masked[p]].sum()) for p in paths], np.int64)
        for p in touched:
            masked[p] = False
    return np.asarray(out, np.int64)


def preorder_segments(pre: Preorder) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(segment bounds (starts, then the tree's size), segment parents, trainable tokens per segment, segment of
    each branch leaf) of a tree: segments are cut at run starts and after branch leaves, so a branch's path is a
    union of whole segments, and every token of a segment has the same subtree end."""
    n = pre.size
    bounds = np.unique(np.concatenate([pre.run_start, pre.branch_leaf + 1, [0, n]]))
    starts = bounds[:-1]
    first_par = pre.parent[starts] if n else np.zeros(0, np.int64)
    seg_parent = np.where(first_par >= 0, np.searchsorted(starts, first_par, "right") - 1, -1)
    targets = pre.trained & (pre.parent >= 0)
    cum = np.concatenate([[0], np.cumsum(targets)])
    seg_weight = cum[bounds[1:]] - cum[starts]
    leaf_seg = np.searchsorted(starts, pre.branch_leaf, "right") - 1
    return bounds, seg_parent.astype(np.int64), seg_weight.astype(np.int64), leaf_seg.astype(np.int64)


def roles_of(pre: Preorder) -> np.ndarray:
    """Role index of each branch (every branch "main" where the tree recorded none)."""
    if pre.branch_role is None or pre.branch_role.shape[0] != pre.branch_leaf.shape[0]:
        return np.zeros(pre.branch_leaf.shape[0], np.int64)
    return pre.branch_role


def sample_branches(pre: Preorder, config: SamplingConfig, rng: np.random.Generator, segments=None) -> np.ndarray:
    """The branches of `pre` role-bounded sampling trains, execution by execution, each in draw order
    (`segments`: preorder_segments(pre), if already computed)."""
    if pre.branch_leaf.shape[0] == 0:
        return np.zeros(0, np.int64)
    _, seg_parent, seg_weight, leaf_seg = segments or preorder_segments(pre)
    return draw_paths(seg_parent, seg_weight, leaf_seg, pre.branch_execution, roles_of(pre), config, rng)


def restrict(pre: Preorder, branches: np.ndarray, segments=None) -> Preorder:
    """The tree cut down to the tokens on the given branches' paths, holding those branches in the order given
    (a kept token's ancestors are kept, so depths stay, and DFS order is the old one with gaps closed). Works
    per segment (`segments`: preorder_segments(pre), if already computed): a segment is kept whole or not."""
    branches = np.asarray(branches, np.int64)
    bounds, seg_parent, _, leaf_seg = segments or preorder_segments(pre)
    starts, lens = bounds[:-1], np.diff(bounds)
    keep_seg = np.zeros(seg_parent.shape[0], bool)
    par = seg_parent.tolist()
    for s in leaf_seg[branches].tolist():
        while s >= 0 and not keep_seg[s]:
            keep_seg[s] = True
            s = par[s]
    roles = roles_of(pre)[branches]
    if keep_seg.all():  # every token stays: only the branches change
        return Preorder(tokens=pre.tokens, depth=pre.depth, parent=pre.parent, leave=pre.leave, trained=pre.trained,
                        logprob=pre.logprob, run_start=pre.run_start, branch_leaf=pre.branch_leaf[branches],
                        branch_execution=pre.branch_execution[branches], branch_role=roles)
    ks = np.flatnonzero(keep_seg)
    klen = lens[ks]
    kbefore = np.concatenate([[0], np.cumsum(klen)])  # new start of each kept segment, then the new size
    cum_seg = np.zeros(keep_seg.shape[0] + 1, np.int64)
    cum_seg[1:] = np.cumsum(np.where(keep_seg, lens, 0))

    def before(x: np.ndarray) -> np.ndarray:
        """Kept tokens before old index x (x may be the old size)."""
        sg = np.minimum(np.searchsorted(bounds, x, "right") - 1, keep_seg.shape[0] - 1)
        inside = np.where(keep_seg[sg], np.minimum(x - starts[sg], lens[sg]), 0)
        return cum_seg[sg] + inside

    keep = np.repeat(keep_seg, lens)
    m = int(kbefore[-1])
    new_start = kbefore[:-1]
    old_par = pre.parent[starts[ks]]
    p_new = np.where(old_par >= 0, before(np.maximum(old_par, 0)), -1)
    parent = np.arange(-1, m - 1, dtype=np.int64)
    parent[new_start] = p_new
    _, inv, cnt = np.unique(p_new, return_inverse=True, return_counts=True)
    run_start = new_start[(p_new < 0) | (cnt[inv] > 1)]
    return Preorder(
        tokens=pre.tokens[keep], depth=pre.depth[keep], parent=parent,
        leave=np.repeat(before(pre.leave[starts[ks]]), klen), trained=pre.trained[keep], logprob=pre.logprob[keep],
        run_start=run_start.astype(np.int64), branch_leaf=before(pre.branch_leaf[branches]),
        branch_execution=pre.branch_execution[branches], branch_role=roles,
    )
