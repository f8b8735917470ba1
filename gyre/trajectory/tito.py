"""TITO records and the trees built from them: what a black-box harness's model calls leave for training.

What it models: a model proxy cannot see a harness's agent loop, only its model calls. Each call is a
`TitoRecord` (token in, token out): the exact input ids the engine was sent, the ids it generated with their
behaviour log-probs and policy version, the call's role (main, main-summary, sub-agent, sub-agent-summary, as
the request stated it: a plain string) and its timings. `TitoTree` rebuilds an execution's part of its task's
prefix tree (gyre.trajectory.tree.TokenTree) from its records, in order:

- each call's input is prefix-matched against the execution's earlier calls (input + output, on token ids
  whatever their kind); the longest match is where it hangs;
- a call that extends an earlier call whole is a new node after it (`extend`); one that leaves an earlier
  context part-way is a branch at the divergence (`branch`: a compaction, a sub-agent, a retry); one that
  shares no token with any earlier call hangs from the root (`root`, where identical environment tokens of
  other executions, such as the task's prompt, are shared by the trie);
- new input tokens are environment tokens (never trained); the output is policy tokens with their log-probs.

`close(execution)` adds one branch per call whose context no later call of the execution continues (the
root-to-leaf paths the model saw), each with the role of the call that ended it, stored in the tree
(`TokenTree.add_branch(..., role)`), so the tree feeds gyre.trajectory's packing, credit and role-bounded
sampling (gyre.trajectory.sample: main > main-summary > sub-agent > sub-agent-summary, at most J_max paths)
as an agent loop's recorder does. A retry has no role of its own: its branch carries the role of the call
that ended it (a retried sub-agent call is a "sub-agent" leaf); a role outside ROLES is stored as "main".

Simplifications: matching compares against the execution's own calls only (other executions share the tree
through identical environment prefixes); locating a divergence walks parent pointers (linear in the tokens
left behind).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.record import Execution, _is_ancestor_or_self
from gyre.trajectory.tree import ROLES, TokenTree


@dataclass(kw_only=True, frozen=True)
class TitoRecord:
    """One model call as the proxy served it."""

    execution: str  # the proxy's execution key
    n: int  # request number within the execution (1, 2, ...)
    role: str  # main | main-summary | sub-agent | sub-agent-summary (as the request stated it)
    input_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour log-probs of output_ids
    version: int  # the policy version that generated them (the oldest, if an update landed mid-call)
    received_s: float  # wall-clock epoch seconds the proxy received the request
    issued_s: float  # backend clock: the request went to an engine
    done_s: float  # backend clock: the engine's answer came back
    engine: int | None = None  # the engine that answered (after any move)
    moved: int = 0  # times the request was cancelled on one engine and re-issued on another

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


class TitoTree:
    """One execution's calls placed into its task's TokenTree (see the module docstring)."""

    def __init__(self, tree: TokenTree, execution_id: int) -> None:
        self.tree = tree
        self.execution_id = execution_id
        self._seqs: list[np.ndarray] = []  # per call: input + output ids
        self._ends: list[int] = []  # per call: tree index of its last token
        self.roles: list[str] = []
        self.generated: list[int] = []  # per call: output tokens
        self.kinds: list[str] = []  # per call: root | extend | branch
        self.leaves: list[tuple[int, str]] = []  # after close: (leaf index, role) per branch

    def add(self, rec: TitoRecord) -> int:
        """Place one call; the tree index of its last generated token."""
        x = np.asarray(rec.input_ids, np.int64)
        y = np.asarray(rec.output_ids, np.int64)
        if x.size == 0 or y.size == 0 or len(rec.logprobs) != y.size:
            raise ValueError(f"record {rec.execution}#{rec.n}: {x.size} input ids, {y.size} output ids, "
                             f"{len(rec.logprobs)} log-probs (each call needs input, output, one log-prob per output)")
        best, k = -1, 0
        for i, s in enumerate(self._seqs):
            m = _common_prefix(s, x)
            if m > k:
                best, k = i, m
        if best < 0:
            at, kind = -1, "root"
        else:
            at = _ancestor(self.tree, self._ends[best], self._seqs[best].size - k)
            kind = "extend" if k == self._seqs[best].size else "branch"
        at = self.tree.append(at, x[k:], trained=False)
        end = self.tree.append(at, y, trained=True, logprobs=np.asarray(rec.logprobs), version=int(rec.version))
        self._seqs.append(np.concatenate([x, y]))
        self._ends.append(end)
        self.roles.append(rec.role)
        self.generated.append(int(y.size))
        self.kinds.append(kind)
        return end

    def close(self, execution: Execution | None = None) -> list[tuple[int, str]]:
        """Add a branch per call no later call continues; with `execution` (the recorder's), close it on them."""
        ends = self._ends
        for i, e in enumerate(ends):
            if e in (x for x, _ in self.leaves):
                continue  # an identical call (same ids, log-probs, version): one path
            if any(j != i and ends[j] != e and _is_ancestor_or_self(self.tree, e, ends[j]) for j in range(len(ends))):
                continue
            role = self.roles[i] if self.roles[i] in ROLES else "main"
            self.tree.add_branch(e, self.execution_id, role)
            self.leaves.append((e, role))
        if execution is not None:
            close_execution(execution, self)
        return self.leaves


def close_execution(ex: Execution, built: TitoTree) -> None:
    """Mark a recorder's Execution as having produced `built`'s branches (its cursor at the last main leaf)."""
    main = [e for e, r in built.leaves if r == "main"] or [e for e, _ in built.leaves]
    if main:
        ex._at = main[-1]
    tree = built.tree
    ex.generated_tokens = int(sum(built.generated))
    versions = tree.version[built._ends] if built._ends else np.zeros(0, np.int64)
    if versions.size:
        ex.oldest_version = min(int(ex.oldest_version), int(versions.min()))
    ex._open = False


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _ancestor(tree: TokenTree, q: int, up: int) -> int:
    """The token `up` steps above q (q itself for 0)."""
    par = tree.parent
    for _ in range(up):
        q = int(par[q])
    return q
