"""The prefix tree of one task: every execution of a GRPO group, shared prefixes stored once.

What it models: token ids (never text) in flat, growable numpy arrays, one entry per unique token, each
with its parent token (-1 for a root), whether the policy produced it (trained), its old log-prob and the
policy version. Appending a run of tokens under a token first follows any existing identical path (same
token, kind, log-prob and version), so a shared prompt or an identical retry is stored once: a trie.
A *branch* is a root-to-leaf path that one execution's model actually saw (a finished context, an
abandoned retry attempt, a sub-agent's context, a context closed by compaction); it is the unit of the
naive per-branch expansion.

`preorder()` lays the tree out in DFS order: per token its depth (= position id), its preorder parent
and the exclusive end of its subtree (`leave`), so "k is an ancestor-or-self of q" is
`enter[k] <= enter[q] < leave[k]` with `enter` the preorder index.

Each branch carries a *role* (`ROLES`): the main agent's context ("main"), a main context closed by
compaction, which ends with the summary it wrote ("main-summary"), a sub-agent's context ("sub-agent") and a
sub-agent's context that ends with its summary ("sub-agent-summary"). Role-bounded sampling
(gyre.trajectory.sample) draws by them; exact packing ignores them.

Simplifications: the DFS visits children in insertion order; tokens are int64, log-probs float64; a token
that is a root cannot be a trained target (nothing predicts it), in the tree and in the naive reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ENV_VERSION = -1  # version stored for environment/tool tokens (they carry log-prob 0.0)
ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")  # branch roles; a Preorder stores their index


@dataclass(kw_only=True, frozen=True)
class Preorder:
    """A tree laid out in DFS order. Every array is indexed by preorder position unless named otherwise."""

    tokens: np.ndarray  # int64 token ids
    depth: np.ndarray  # int64, 0 at a root: the position id
    parent: np.ndarray  # int64 preorder index of the parent token, -1 at a root
    leave: np.ndarray  # int64 exclusive end of the token's subtree
    trained: np.ndarray  # bool: produced by the policy (a loss target on every branch through it)
    logprob: np.ndarray  # float64 old log-prob (0.0 for environment tokens)
    run_start: np.ndarray  # int64 sorted preorder starts of maximal unbranched runs (good cut points)
    branch_leaf: np.ndarray  # int64 preorder index of each branch's last token (branch order)
    branch_execution: np.ndarray  # int64 execution id of each branch
    branch_role: np.ndarray | None = None  # int64 index into ROLES of each branch (None: every branch "main")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def path(self, q: int) -> np.ndarray:
        """Preorder indices of the ancestors-or-self of position q, root first."""
        out = []
        while q >= 0:
            out.append(q)
            q = int(self.parent[q])
        return np.asarray(out[::-1], dtype=np.int64)

    def executions_through(self, q: int) -> np.ndarray:
        """Sorted ids of the executions with a branch passing through position q."""
        inside = (self.branch_leaf >= q) & (self.branch_leaf < self.leave[q])
        return np.unique(self.branch_execution[inside])

    def of_execution(self, execution: int) -> Preorder:
        """The tree of one execution's branches alone (a streaming step's micro-step), as execution 0.

        Kept: the tokens on a path from a root to one of its branch leaves (k is kept iff one of them lies in
        [k, leave[k])), an ancestor-closed set, so the kept tokens in this order are the sub-tree's preorder.
        Its branches are the execution's, in branch order, so its loss rows are exactly the execution's rows
        of the whole tree. Run starts: the kept ones (runs may now be split where a fork lost its other
        children; a finer split is still unbranched, so the packer stays exact)."""
        mine = self.branch_execution == execution
        leaves = self.branch_leaf[mine]
        srt = np.sort(leaves)
        keep = np.searchsorted(srt, self.leave, "left") > np.searchsorted(srt, np.arange(self.size), "left")
        new = np.cumsum(keep) - 1  # old index -> new index (of kept tokens)
        below = np.concatenate([[0], np.cumsum(keep)])  # kept tokens before old index i
        par = self.parent[keep]
        return Preorder(
            tokens=self.tokens[keep], depth=self.depth[keep], parent=np.where(par >= 0, new[par], -1),
            leave=below[self.leave[keep]], trained=self.trained[keep], logprob=self.logprob[keep],
            run_start=new[self.run_start[keep[self.run_start]]], branch_leaf=new[leaves],
            branch_execution=np.zeros(leaves.shape[0], np.int64),
        )


class TokenTree:
    """Append-only token trie of one task; `append` returns the buffer index of the last token."""

    def __init__(self, task_id: str = "task", capacity: int = 1024) -> None:
        self.task_id = task_id
        self.size = 0
        self._tok = np.empty(capacity, np.int64)
        self._parent = np.empty(capacity, np.int64)
        self._trained = np.empty(capacity, bool)
        self._logprob = np.empty(capacity, np.float64)
        self._version = np.empty(capacity, np.int64)
        # Children that are not the implicit continuation `p + 1`: parent index (-1 for roots) -> starts.
        self._forks: dict[int, list[int]] = {}
        self.branch_leaf: list[int] = []
        self.branch_execution: list[int] = []
        self.branch_role: list[int] = []  # index into ROLES

    # ---- reading -----------------------------------------------------------------------------------

    @property
    def tokens(self) -> np.ndarray:
        return self._tok[: self.size]

    @property
    def parent(self) -> np.ndarray:
        return self._parent[: self.size]

    @property
    def trained(self) -> np.ndarray:
        return self._trained[: self.size]

    @property
    def logprob(self) -> np.ndarray:
        return self._logprob[: self.size]

    @property
    def version(self) -> np.ndarray:
        return self._version[: self.size]

    def children(self, p: int) -> list[int]:
        """Buffer indices of the children of token p (p = -1: the roots), in insertion order."""
        out = []
        if p >= 0 and p + 1 < self.size and self._parent[p + 1] == p:
            out.append(p + 1)
        out.extend(self._forks.get(p, ()))
        return sorted(out)

    def path_tokens(self, leaf: int) -> np.ndarray:
        """Token ids from the root to `leaf` (inclusive), by walking parent pointers."""
        idx = []
        while leaf >= 0:
            idx.append(leaf)
            leaf = int(self._parent[leaf])
        return self._tok[np.asarray(idx[::-1], dtype=np.int64)]

    def check_index(self, i: int, what: str) -> None:
        if not (-1 <= i < self.size):
            raise ValueError(f"{what}: unknown token index {i} in tree {self.task_id!r} of {self.size} tokens")

    # ---- writing -----------------------------------------------------------------------------------

    def add_branch(self, leaf: int, execution: int, role: str = "main") -> None:
        """Record that `execution`'s model saw the path root..leaf as one context, in `role` (one of ROLES)."""
        if not 0 <= leaf < self.size:
            raise ValueError(f"branch leaf {leaf} is not a token of tree {self.task_id!r}")
        if role not in ROLES:
            raise ValueError(f"branch role {role!r} of tree {self.task_id!r} is not one of {ROLES}")
        self.branch_leaf.append(leaf)
        self.branch_execution.append(execution)
        self.branch_role.append(ROLES.index(role))

    def append(self, parent: int, tokens, *, trained: bool, logprobs=None, version: int = ENV_VERSION) -> int:
        """Append `tokens` under token `parent` (-1: a new root), reusing identical existing paths."""
        self.check_index(parent, "append")
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.shape[0]
        if n == 0:
            return parent
        if trained:
            if logprobs is None:
                raise ValueError("model tokens need log-probs")
            lps = np.asarray(logprobs, dtype=np.float64).reshape(-1)
            if lps.shape[0] != n:
                raise ValueError(f"got {n} model tokens but {lps.shape[0]} log-probs")
            if not np.all(np.isfinite(lps)) or np.any(lps > 0):
                raise ValueError("log-probs must be finite and <= 0")
        else:
            lps = np.zeros(n, np.float64)
            version = ENV_VERSION
        i = 0
        while i < n:
            child = self._matching_child(parent, toks[i], trained, lps[i], version)
            if child is None:
                break
            m = self._common_run(child, toks[i:], lps[i:], trained, version)
            parent, i = child + m - 1, i + m
        if i < n:
            parent = self._append_new(parent, toks[i:], lps[i:], trained, version)
        return parent

    def _matching_child(self, p: int, tok, trained: bool, lp, version: int) -> int | None:
        for c in self.children(p):
            if (
                self._tok[c] == tok
                and self._trained[c] == trained
                and self._logprob[c] == lp
                and self._version[c] == version
            ):
                return c
        return None

    def _common_run(self, c: int, toks: np.ndarray, lps: np.ndarray, trained: bool, version: int) -> int:
        """Length of the match between toks and the unbranched buffer run starting at c (>= 1)."""
        m = min(toks.shape[0], self.size - c)
        sl = slice(c, c + m)
        ok = (self._tok[sl] == toks[:m]) & (self._logprob[sl] == lps[:m])
        ok &= (self._trained[sl] == trained) & (self._version[sl] == version)
        ok[1:] &= self._parent[c + 1 : c + m] == np.arange(c, c + m - 1)
        bad = np.flatnonzero(~ok)
        return m if bad.shape[0] == 0 else int(bad[0])

    def _append_new(self, p: int, toks: np.ndarray, lps: np.ndarray, trained: bool, version: int) -> int:
        n, s = toks.shape[0], self.size
        self._reserve(s + n)
        self._tok[s : s + n] = toks
        self._parent[s] = p
        self._parent[s + 1 : s + n] = np.arange(s, s + n - 1)
        self._trained[s : s + n] = trained
        self._logprob[s : s + n] = lps
        self._version[s : s + n] = version
        if p < 0 or p != s - 1:
            self._forks.setdefault(p, []).append(s)
        self.size = s + n
        return s + n - 1

    def _reserve(self, need: int) -> None:
        cap = self._tok.shape[0]
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name in ("_tok", "_parent", "_trained", "_logprob", "_version"):
            old = getattr(self, name)
            arr = np.empty(new, old.dtype)
            arr[: self.size] = old[: self.size]
            setattr(self, name, arr)

    # ---- layout ------------------------------------------------------------------------------------

    def preorder(self) -> Preorder:
        """DFS layout (children in insertion order): a Python walk over unbranched runs, numpy per token.

        A token starts a run iff it is registered as a fork (its parent is not the previous buffer token,
        or it is a root) or it continues a token that also has forks; so runs come from `_forks` alone.
        """
        n = self.size
        par = self._parent
        start_set = {c for kids in self._forks.values() for c in kids}
        start_set.update(p + 1 for p in self._forks if 0 <= p < n - 1 and par[p + 1] == p)
        starts = np.array(sorted(start_set), np.int64)
        lens = np.diff(np.append(starts, n))
        nr = starts.shape[0]
        # A run hangs under the run ending with its first token's parent (a fork point always ends a run).
        first_par = par[starts]
        rpar = np.where(first_par >= 0, np.searchsorted(starts, first_par, "right") - 1, -1)
        kids: dict[int, list[int]] = {}
        for r, pr in enumerate(rpar.tolist()):
            kids.setdefault(pr, []).append(r)
        pstart = np.zeros(nr, np.int64)
        rdepth = np.zeros(nr, np.int64)
        rleave = np.zeros(nr, np.int64)
        lens_l, kids_get = lens.tolist(), kids.get
        order: list[int] = []
        pos = 0
        stack = [(r, 0, True) for r in reversed(kids_get(-1, []))]
        while stack:
            r, d, entering = stack.pop()
            if not entering:
                rleave[r] = pos
                continue
            order.append(r)
            pstart[r], rdepth[r] = pos, d
            pos += lens_l[r]
            stack.append((r, 0, False))
            child_depth = d + lens_l[r]
            stack.extend((c, child_depth, True) for c in reversed(kids_get(r, [])))
        ro = np.asarray(order, np.int64)
        rl = lens[ro]
        sl = [slice(int(a), int(a + b)) for a, b in zip(starts[ro], rl)]
        take = lambda arr: np.concatenate([arr[x] for x in sl]) if sl else arr[:0].copy()  # noqa: E731
        idx = np.arange(n, dtype=np.int64)
        depth = idx + np.repeat(rdepth[ro] - pstart[ro], rl)
        parent = idx - 1
        has_par = rpar[ro] >= 0
        pr = rpar[ro][has_par]
        parent[pstart[ro]] = -1
        parent[pstart[ro][has_par]] = pstart[pr] + lens[pr] - 1
        leaves = np.asarray(self.branch_leaf, np.int64)
        lr = np.searchsorted(starts, leaves, "right") - 1
        return Preorder(
            tokens=take(self._tok),
            depth=depth,
            parent=parent,
            leave=np.repeat(rleave[ro], rl),
            trained=take(self._trained),
            logprob=take(self._logprob),
            run_start=np.sort(pstart),
            branch_leaf=pstart[lr] + leaves - starts[lr],
            branch_execution=np.asarray(self.branch_execution, np.int64),
            branch_role=np.asarray(self.branch_role, np.int64),
        )
