"""Recording API: what an execution did, on exact token ids, straight into its task's prefix tree.

What it models: a `TaskRecorder` owns one task's `TokenTree` (the GRPO group's shared prompt is its first
root). `start()` opens an `Execution` whose cursor sits at the end of the prompt. The execution appends
model tokens (with old log-probs and the policy version that produced them) and environment/tool tokens,
and may:

- `fork()` a sub-agent: a `SubAgent` cursor, a child at the fork point, closed with `close()`;
- `retry(at)` from an earlier point on its current context: the abandoned attempt becomes a branch;
- `compact(context)`: the current context ends (a branch) and a new root holding `context` (system prompt +
  summary, environment tokens) starts; the link old leaf -> new context is kept in `links`;
- `finish(reward)` or `hit_deadline()` (scored later by partial credit, see credit.py).

Every branch closed here is one root-to-leaf path the model saw; all of an execution's branches (sub-agents
included) share its reward. `Point`s are opaque handles to a token of one tree. Each branch gets its role
(gyre.trajectory.tree.ROLES): an execution's own contexts are "main", the one a compaction closes
"main-summary" (the summary is generated in it), a sub-agent's "sub-agent", or "sub-agent-summary" when it
is closed with `close(summary=True)`; an abandoned retry attempt keeps its agent's plain role.

Simplifications: sub-agents cannot compact; closing an execution closes its open sub-agents; the compacted
context is environment tokens (the summary itself is generated, and trained, in the old context).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.tree import TokenTree


@dataclass(frozen=True)
class Point:
    """A token of one task's tree (index -1 never escapes: prompts are non-empty)."""

    task_id: str
    index: int


@dataclass(kw_only=True, frozen=True)
class ReachedState:
    """What a truncated (or finished) execution reached: handed to a partial-credit reward function."""

    execution: int
    context_tokens: np.ndarray  # token ids of the current context, root first
    generated_tokens: int  # model tokens appended by this execution (all contexts, sub-agents included)
    contexts: int  # 1 + number of compactions
    truncated: bool


class Cursor:
    """One context being extended: an execution's main line or one of its sub-agents."""

    role = "main"  # the role of this cursor's plain branches

    def __init__(self, execution: Execution, at: int, label: str) -> None:
        self._ex = execution
        self._at = at
        self._label = label
        self._open = True
        self._subagents: list[SubAgent] = []

    @property
    def point(self) -> Point:
        return Point(self._ex.recorder.task_id, self._at)

    def _check_open(self, verb: str) -> None:
        if not self._open:
            raise ValueError(f"{self._label} is closed ({self._ex.status}); cannot {verb}")

    def _resolve(self, at: Point | None, verb: str) -> int:
        """Index of `at`, which must be a token on this cursor's current context (ancestor-or-self)."""
        if at is None:
            return self._at
        if not isinstance(at, Point) or at.task_id != self._ex.recorder.task_id:
            raise ValueError(f"{self._label}: cannot {verb} from {at!r}: not a point of task {self._ex.recorder.task_id!r}")
        tree = self._ex.recorder.tree
        if not (0 <= at.index < tree.size) or not _is_ancestor_or_self(tree, at.index, self._at):
            raise ValueError(f"{self._label}: cannot {verb} from unknown node {at.index}: not on its current context")
        return at.index

    def append_model(self, tokens, logprobs, version: int) -> Point:
        """Append policy tokens with their old log-probs and the policy version that produced them."""
        self._check_open("append tokens")
        if int(version) < 0:
            raise ValueError(f"{self._label}: policy version must be >= 0, got {version}")
        n = np.asarray(tokens).size
        self._at = self._ex.recorder.tree.append(self._at, tokens, trained=True, logprobs=logprobs, version=int(version))
        self._ex.generated_tokens += n
        self._ex.oldest_version = min(self._ex.oldest_version, int(version))
        return self.point

    def append_env(self, tokens) -> Point:
        """Append environment/tool tokens (never trained)."""
        self._check_open("append tokens")
        self._at = self._ex.recorder.tree.append(self._at, tokens, trained=False)
        return self.point

    def fork(self, at: Point | None = None) -> SubAgent:
        """Open a sub-agent whose context continues from `at` (default: here)."""
        self._check_open("fork")
        start = self._resolve(at, "fork")
        sub = SubAgent(self._ex, start, f"{self._label}/sub{len(self._subagents)}")
        self._subagents.append(sub)
        return sub

    def retry(self, at: Point) -> Point:
        """Abandon the attempt after `at` (kept as a branch) and continue from `at`."""
        self._check_open("retry")
        start = self._resolve(at, "retry")
        if start != self._at:
            self._ex.recorder.tree.add_branch(self._at, self._ex.id, self.role)
        self._at = start
        return self.point

    def _close(self, role: str | None = None) -> None:
        for sub in self._subagents:
            if sub._open:
                sub._close()
        self._ex.recorder.tree.add_branch(self._at, self._ex.id, role or self.role)
        self._open = False


class SubAgent(Cursor):
    """A sub-agent of an execution: same execution id and reward, its own branch."""

    role = "sub-agent"

    def close(self, summary: bool = False) -> None:
        """Close the sub-agent's context; `summary`: it ends with the summary the sub-agent wrote."""
        self._check_open("close")
        self._close("sub-agent-summary" if summary else None)


class Execution(Cursor):
    """One rollout of a task; `status` is running, finished or truncated."""

    def __init__(self, recorder: TaskRecorder, execution_id: int, at: int) -> None:
        self.recorder = recorder
        self.id = execution_id
        self.status = "running"
        self.reward: float | None = None
        self.generated_tokens = 0
        self.oldest_version = np.iinfo(np.int64).max
        self.contexts = 1
        self.links: list[tuple[Point, Point]] = []  # (old context leaf, end of the new context's root)
        super().__init__(self, at, f"execution {execution_id} of task {recorder.task_id!r}")

    def compact(self, context_tokens) -> Point:
        """End the current context and start a new root from `context_tokens` (linked to the old leaf)."""
        self._check_open("compact")
        if np.asarray(context_tokens).size == 0:
            raise ValueError(f"{self._label}: compaction needs a non-empty new context")
        old = self.point
        for sub in self._subagents:
            if sub._open:
                sub._close()
        self._subagents = []
        self.recorder.tree.add_branch(self._at, self.id, "main-summary")
        self._at = self.recorder.tree.append(-1, context_tokens, trained=False)
        self.contexts += 1
        self.links.append((old, self.point))
        return self.point

    def finish(self, reward: float) -> None:
        """The execution ended on its own with `reward`."""
        self._check_open("finish")
        if not np.isfinite(reward):
            raise ValueError(f"{self._label}: reward must be finite, got {reward}")
        self._close()
        self.status, self.reward = "finished", float(reward)

    def hit_deadline(self) -> None:
        """The execution ran out of time: flagged truncated, scored later on the state it reached."""
        self._check_open("hit the deadline")
        self._close()
        self.status = "truncated"

    def reached_state(self) -> ReachedState:
        return ReachedState(
            execution=self.id,
            context_tokens=self.recorder.tree.path_tokens(self._at),
            generated_tokens=self.generated_tokens,
            contexts=self.contexts,
            truncated=self.status == "truncated",
        )


class TaskRecorder:
    """All executions of one task (a GRPO group), recorded into one prefix tree."""

    def __init__(self, task_id: str, prompt) -> None:
        if np.asarray(prompt).size == 0:
            raise ValueError(f"task {task_id!r}: the prompt must be non-empty")
        self.task_id = task_id
        self.tree = TokenTree(task_id)
        self.prompt_end = self.tree.append(-1, prompt, trained=False)
        self.executions: list[Execution] = []

    def start(self) -> Execution:
        """A new execution whose context starts with the task prompt."""
        ex = Execution(self, len(self.executions), self.prompt_end)
        self.executions.append(ex)
        return ex


def _is_ancestor_or_self(tree: TokenTree, a: int, q: int) -> bool:
    """Whether token a lies on the root path of token q (parents always precede children in the buffer)."""
    par = tree.parent
    while q > a:
        contiguous = par[a + 1 : q + 1] == np.arange(a, q)
        bad = np.flatnonzero(~contiguous)
        if bad.shape[0] == 0:
            return True
        q = int(par[a + 1 + int(bad[-1])])
    return q == a
