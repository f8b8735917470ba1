"""Workload model: GRPO groups of agent executions, each a chain of segments.

An execution is a prompt followed by segments. A segment is one model turn: `gen` generated tokens,
then (except after the last segment) a tool call taking `tool_s` seconds that appends `tool_out`
tokens to the context. Branching changes what the engine must hold, and is folded into `kv`, the
KV footprint (context tokens resident on the engine) at the start of each segment:

- compaction: when the context passes the window, the agent writes a summary (a segment of
  `summary_tokens`) and continues from a fresh root holding only that summary;
- sub-agent: a child context starts (the parent's stays resident) for a few turns, then its result
  is appended to the parent and the child's KV is freed;
- retry: the agent rolls back a few turns; the abandoned turns' tokens stay in the trajectory (they
  are trained as a branch) but leave the context.

Seen as a trajectory tree (`execution_tree`, what role-bounded path sampling draws from), each segment hangs
under the previous segment of its context: a compaction closes the context (a "main-summary" leaf; a
sub-agent's: "sub-agent-summary") and the next segment starts a new root; a sub-agent's turns form their own
context from a fresh root, closed as a "sub-agent" leaf; a retry closes the abandoned turns as a leaf of the
agent's role and continues under the segment before the turn it rolled back to; the last context is a "main"
leaf.

Simplifications: per-turn quantities are independent draws (lognormal bodies, a slow-tool mixture
for latency); a task's difficulty scales the number of turns of every execution in its group; drift
multiplies the turn count by (1 + drift_per_step) ** step.

Recurring tasks (`task_set` > 0): groups are drawn from a finite set of tasks that the run visits in
epochs, each epoch once per task in a fresh random order (group g is in epoch g // task_set). A task
keeps its prompt, and its log-difficulty follows a stationary AR(1) over epochs: z_0 ~ N(0, 1),
z_k = rho z_(k-1) + sqrt(1 - rho^2) e_k, difficulty = exp(sigma_d z_k), so every epoch has the same
spread of difficulty as fresh tasks (`difficulty_p99_ratio`) and consecutive epochs of one task have
log-difficulty correlation rho = `task_epoch_corr`. That a prompt's rollouts look alike from one epoch
to the next is the observation RhymeRL (arXiv 2508.18588, "rollout responses exhibit remarkable
similarity across adjacent training epochs") builds HistoPipe on; the value of rho a preset uses is its
own assumption (see gyre.presets). The executions of a group still draw their turns independently
around the task's difficulty, so history predicts a group's scale, never its exact lengths. With
`task_set` = 0 every group is a fresh task (task id = group id), as without this option. The turn count has a point mass at
`max_turns` (the length cap), and a turn's generation can be capped at `max_gen_tokens`: an execution
whose turn draw exceeds the turn cap, or whose last turn's generation exceeds the token cap, ends
capped (truncated, with partial credit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class LogNormal:
    """A lognormal by its median and its p99/median ratio (sigma = ln(ratio) / z_0.99)."""

    median: float
    p99_ratio: float

    @property
    def sigma(self) -> float:
        return math.log(self.p99_ratio) / 2.3263478740408408 if self.p99_ratio > 1 else 0.0

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        return self.median * scale * np.exp(self.sigma * rng.standard_normal(size))


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: str
    groups_per_step: int
    group_size: int
    prompt_tokens: LogNormal
    turns: LogNormal
    max_turns: int
    max_gen_tokens: int = 0  # per-turn generation cap (0: none); a single-turn execution reaching it is capped
    gen_tokens: LogNormal  # per turn
    tool_out_tokens: LogNormal  # per tool call
    tool_s: LogNormal  # per tool call, typical
    slow_tool_p: float = 0.0  # share of tool calls that are slow (tests, builds)
    slow_tool_s: LogNormal = field(default_factory=lambda: LogNormal(median=10.0, p99_ratio=5.0))
    context_window: int = 131072
    summary_tokens: int = 4096
    subagent_p: float = 0.0  # per turn
    subagent_turns: int = 8
    retry_p: float = 0.0  # per turn
    retry_back_turns: int = 3
    difficulty_p99_ratio: float = 1.0  # spread of per-task difficulty
    drift_per_step: float = 0.0
    deadline_s: float = math.inf  # wall-clock budget per execution from its start
    task_set: int = 0  # recurring tasks: size of the task set the groups cycle through (0: every group a fresh task)
    task_epoch_corr: float = 0.0  # correlation of a task's log-difficulty between consecutive epochs
    steps_per_burst: int = 1  # mu: training steps per weight publication (engines serve every mu-th version)

    def __post_init__(self) -> None:
        for name in ("groups_per_step", "group_size", "max_turns", "context_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        d = self.deadline_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0:  # NaN fails too; inf: no deadline
            raise ValueError(f"workload.deadline_s must be a positive number of seconds, got {d!r}")
        if self.summary_tokens >= self.context_window:
            raise ValueError("workload.summary_tokens must be below workload.context_window")
        mu = self.steps_per_burst
        if isinstance(mu, bool) or not isinstance(mu, int) or mu < 1:
            raise ValueError(f"workload.steps_per_burst must be an integer >= 1, got {mu!r}")
        if self.task_set < 0:
            raise ValueError(f"workload.task_set must be >= 0, got {self.task_set}")
        if not -1.0 <= self.task_epoch_corr <= 1.0:
            raise ValueError(f"workload.task_epoch_corr must be in [-1, 1], got {self.task_epoch_corr}")

    @property
    def max_context(self) -> int:
        """The longest context the workload lets an execution reach (what vLLM calls max_model_len; the
        admission limit's denominator, gyre.hardware.admission_limit): its compaction window; for a single-turn
        workload with a generation cap, the prompt's 99th percentile plus that cap when smaller (a prompt
        filter at p99, as RL recipes set max_prompt_length, and max_tokens)."""
        if self.max_turns == 1 and self.max_gen_tokens:
            p99 = self.prompt_tokens.median * self.prompt_tokens.p99_ratio
            return min(self.context_window, math.ceil(p99) + self.max_gen_tokens)
        return self.context_window


@dataclass(kw_only=True)
class ExecutionSpec:
    """What one execution will do. Backends read it; policies never see it (no future knowledge)."""

    exec_id: int
    group_id: int
    task_id: int
    step: int
    prompt: int
    gen: list[int]  # per segment
    tool_s: list[float]  # per tool call (len(gen) - 1)
    tool_out: list[int]  # per tool call
    kv: list[int]  # KV footprint at each segment start
    branches: list[tuple[int, str]]  # (segment index, "compact" | "subagent" | "retry")
    capped: bool  # hit max_turns: ends truncated
    deadline_s: float

    @property
    def tokens(self) -> int:
        """Unique trajectory tokens (prompt + generated + tool output), not context-inclusive."""
        return self.prompt + sum(self.gen) + sum(self.tool_out)


@dataclass(kw_only=True)
class GroupSpec:
    group_id: int
    task_id: int
    step: int
    executions: list[ExecutionSpec]
    # the scale its turn counts were drawn at (task difficulty x growth): the generator's, not the spec's (a trace
    # does not record it, reads back 1.0, and compares equal)
    scale: float = field(default=1.0, compare=False)


def _kv_footprint(prompt: int, gen: np.ndarray, tool_out: np.ndarray, events: np.ndarray, w: WorkloadConfig):
    """Walk the turns once; return KV at each segment start and the branch list.

    events[i]: 0 plain, 1 sub-agent starts at turn i, 2 retry at turn i. Runs of plain turns are
    done with a cumulative sum (vectorized); only branch turns take the per-turn path.
    """
    n = len(gen)
    inc = gen.astype(np.int64).copy()
    inc[: n - 1] += tool_out[: n - 1]
    cs = np.concatenate(([0], np.cumsum(inc)))
    special = np.flatnonzero(events)
    kv = np.zeros(n, dtype=np.int64)
    hist = np.zeros(n, dtype=np.int64)  # active context before each turn, for retries
    branches: list[tuple[int, str]] = []
    window = w.context_window
    ctx, parent, sub_left, i = prompt, 0, 0, 0
    while i < n:
        if not sub_left and not events[i] and ctx <= window:
            nxt = special[np.searchsorted(special, i)] if special.size and special[-1] >= i else n
            run = ctx + cs[i:nxt] - cs[i]
            stop = i + int(np.searchsorted(run, window, side="right"))  # first turn over the window
            kv[i:stop] = run[: stop - i]
            hist[i:stop] = run[: stop - i]
            ctx += int(cs[stop] - cs[i])
            i = stop
            continue
        if ctx + parent > window:
            ctx = w.summary_tokens
            branches.append((i, "compact"))
        if sub_left == 0 and events[i] == 1 and i + 1 < n:
            parent, ctx, sub_left = ctx, w.summary_tokens // 4, w.subagent_turns
            branches.append((i, "subagent"))
        elif events[i] == 2 and i > w.retry_back_turns:
            ctx = int(hist[i - w.retry_back_turns])
            branches.append((i, "retry"))
        hist[i] = ctx
        kv[i] = ctx + parent
        ctx += int(inc[i])
        if sub_left:
            sub_left -= 1
            if sub_left == 0:
                ctx, parent = parent + int(gen[i]), 0
        i += 1
    return kv.tolist(), branches


_TASK_STREAM, _ORDER_STREAM = 1_000_003, 1_000_033  # seed-sequence keys of the task streams (apart from group ids)


def task_of(w: WorkloadConfig, group_id: int, seed: int) -> tuple[int, int]:
    """(task id, epoch) of a group: fresh tasks without a task set, else the epoch's shuffled task order."""
    if not w.task_set:
        return group_id, 0
    epoch, i = divmod(group_id, w.task_set)
    order = np.random.default_rng([seed, _ORDER_STREAM, epoch]).permutation(w.task_set)
    return int(order[i]), epoch


def task_difficulty(w: WorkloadConfig, task: int, epoch: int, seed: int) -> float:
    """A recurring task's difficulty in an epoch (the stationary AR(1) of the module docstring)."""
    e = np.random.default_rng([seed, _TASK_STREAM, task]).standard_normal(epoch + 1)
    rho = w.task_epoch_corr
    z = float(e[0])
    for k in range(1, epoch + 1):
        z = rho * z + math.sqrt(1.0 - rho * rho) * float(e[k])
    return math.exp(LogNormal(median=1.0, p99_ratio=w.difficulty_p99_ratio).sigma * z)


def task_prompt(w: WorkloadConfig, task: int, seed: int) -> int:
    """A recurring task's prompt length (the same in every epoch)."""
    return int(max(1, w.prompt_tokens.sample(np.random.default_rng([seed, _TASK_STREAM, task, 1]), 1)[0]))


def sample_group(w: WorkloadConfig, group_id: int, step: int, seed: int) -> GroupSpec:
    """One GRPO group. Deterministic in (seed, group_id): every policy sees the same workload.

    Per-turn quantities of the whole group are drawn in one vectorized call each, then split.
    """
    rng = np.random.default_rng([seed, group_id])
    g = w.group_size
    difficulty = LogNormal(median=1.0, p99_ratio=w.difficulty_p99_ratio).sample(rng, 1)[0]
    prompt = int(max(1, w.prompt_tokens.sample(rng, 1)[0]))  # one task, one prompt
    task, epoch = task_of(w, group_id, seed)
    if w.task_set:  # a recurring task: its own difficulty and prompt (the draws above keep the stream aligned)
        difficulty = task_difficulty(w, task, epoch, seed)
        prompt = task_prompt(w, task, seed)
    scale = difficulty * (1.0 + w.drift_per_step) ** step
    turns_f = w.turns.sample(rng, g, scale)
    n_drawn = np.maximum(np.rint(turns_f), 1)
    # the draw wanted more turns than the cap allows (a single-turn task has one turn by its shape: no cap)
    capped = (n_drawn > w.max_turns) & (w.max_turns > 1)
    n = np.minimum(n_drawn, w.max_turns).astype(np.int64)
    total = int(n.sum())
    gen = np.maximum(1, w.gen_tokens.sample(rng, total)).astype(np.int64)
    if w.max_gen_tokens:  # a per-turn generation cap: an execution whose last turn is cut by it is capped
        over = gen >= w.max_gen_tokens  # reaching max_tokens ends the turn by length, as in vLLM
        gen = np.minimum(gen, w.max_gen_tokens)
        capped = capped | over[np.cumsum(n) - 1]
    tool_out = np.maximum(0, w.tool_out_tokens.sample(rng, total)).astype(np.int64)
    lat = w.tool_s.sample(rng, total)
    if w.slow_tool_p > 0:
        slow = rng.random(total) < w.slow_tool_p
        lat = np.where(slow, w.slow_tool_s.sample(rng, total), lat)
    u = rng.random(total)
    events = np.where(u < w.subagent_p, 1, np.where(u < w.subagent_p + w.retry_p, 2, 0))
    bounds = np.concatenate(([0], np.cumsum(n)))
    execs = []
    for k in range(g):
        a, b = int(bounds[k]), int(bounds[k + 1])
        kv, branches = _kv_footprint(prompt, gen[a:b], tool_out[a:b], events[a:b], w)
        execs.append(
            ExecutionSpec(
                exec_id=group_id * g + k,
                group_id=group_id,
                task_id=task,
                step=step,
                prompt=prompt,
                gen=gen[a:b].tolist(),
                tool_s=lat[a : b - 1].tolist(),
                tool_out=tool_out[a : b - 1].tolist(),
                kv=kv,
                branches=branches,
                capped=bool(capped[k]),
                deadline_s=w.deadline_s,
            )
        )
    return GroupSpec(group_id=group_id, task_id=task, step=step, executions=execs, scale=float(scale))


class WorkloadSource:
    """Hands out groups in order; group g is meant for step g // groups_per_step."""

    def __init__(self, w: WorkloadConfig, seed: int) -> None:
        self.config = w
        self.seed = seed
        self.issued = 0

    def next_group(self) -> GroupSpec:
        g = self.issued
        self.issued += 1
        return sample_group(self.config, g, g // self.config.groups_per_step, self.seed)


class ReplaySource:
    """Hands out recorded groups in their recorded order (trace replay, not resampled)."""

    def __init__(self, groups: list[GroupSpec], config: WorkloadConfig) -> None:
        self.groups = groups
        self.config = config
        self.issued = 0

    def next_group(self) -> GroupSpec:
        if self.issued >= len(self.groups):
            raise IndexError(f"the trace holds {len(self.groups)} groups; the policy asked for more")
        g = self.groups[self.issued]
        self.issued += 1
        return g


def execution_tree(spec: ExecutionSpec, w: WorkloadConfig) -> tuple[list[int], list[tuple[int, str]]]:
    """One execution as a tree of its segments: (parent segment of each, -1 where a segment starts a context;
    leaves as (last segment, role), in the order their contexts close). The walk follows `_kv_footprint`'s
    branch events; a retry rolls back within the agent's current context (to its root if the turn rolled
    back to lies before it)."""
    n = len(spec.gen)
    events: dict[int, list[str]] = {}
    for i, kind in spec.branches:
        events.setdefault(i, []).append(kind)
    parent = [-1] * n
    owner = [0] * n  # 0: the main agent, k > 0: the k-th sub-agent
    leaves: list[tuple[int, str]] = []
    cur, main_root = -1, 0  # the main context's last segment (-1: its root) and its first segment
    sub, sub_id, sub_root, sub_left = None, 0, 0, 0

    def close(at: int, role: str) -> None:
        if at >= 0:
            leaves.append((at, role))

    def rollback(i: int, who: int, root: int) -> int:
        j = i - w.retry_back_turns
        while j >= root and owner[j] != who:
            j -= 1
        return parent[j] if j >= root else -1

    for i in range(n):
        for kind in events.get(i, ()):
            if kind == "compact":
                if sub is not None:
                    close(sub, "sub-agent-summary")
                    sub, sub_root = -1, i
                else:
                    close(cur, "main-summary")
                    cur, main_root = -1, i
            elif kind == "subagent":
                sub_id += 1
                sub, sub_root, sub_left = -1, i, w.subagent_turns
            elif kind == "retry":
                if sub is not None:
                    close(sub, "sub-agent")
                    sub = rollback(i, sub_id, sub_root)
                else:
                    close(cur, "main")
                    cur = rollback(i, 0, main_root)
        if sub is not None:
            parent[i], owner[i], sub = sub, sub_id, i
            sub_left -= 1
            if sub_left == 0:
                close(sub, "sub-agent")
                sub = None
        else:
            parent[i], cur = cur, i
    if sub is not None:
        close(sub, "sub-agent")
    close(cur, "main")
    return parent, leaves
