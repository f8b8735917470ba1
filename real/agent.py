"""One live agent execution as the real backend drives it: a state machine over exact token ids.

What it models: the agent loop of gyre.real.task (model turn -> tool call -> tool output -> model turn),
recorded as it happens into the group's gyre.trajectory TaskRecorder (policy tokens with their
log-probs and version, environment tokens, sub-agent forks, retries, compactions, finish or deadline).
The driver owns the context, so an engine only ever holds a cache of it: moving an execution (policy
migration or engine fault) means sending the same context to another engine, which re-prefills it.

The state machine performs no I/O: `start`, `on_generated` and `on_tool` return the next request,
a `Generate` (to the execution's engine), a `Tool` (to the tool server) or `Done`; the backend runs it.

Simplifications: one open sub-agent at a time; a segment lost to an engine fault is regenerated from
the last tool-call boundary (nothing of it was recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.cluster import Phase
from gyre.handles import Handle
from gyre.real import task as T
from gyre.trajectory import Score, TaskRecorder, score_group


@dataclass(frozen=True)
class Generate:
    seq: str  # engine-side sequence id (its KV cache key)
    context: list[int]
    max_new: int


@dataclass(frozen=True)
class Tool:
    call: T.ToolCall


@dataclass(frozen=True)
class Done:
    truncated: bool
    end: int = 0  # the log's finish code: 0 done, 1 capped (max_turns), 2 deadline hit


class RealGroup:
    """One task's GRPO group: its executions and the prefix tree they are recorded into."""

    def __init__(self, group_id: int, spec: T.TaskSpec, size: int, first_exec_id: int, cfg: T.TaskConfig,
                 seed: int) -> None:
        self.id = group_id
        self.task_id = spec.task_id
        self.spec = spec
        self.recorder = TaskRecorder(f"task{spec.task_id}", np.asarray(spec.prompt, np.int64))
        # one generator per execution: its tool latencies do not depend on how executions interleave
        self.executions = [RealExecution(first_exec_id + i, self, cfg, np.random.default_rng([seed, first_exec_id + i]))
                           for i in range(size)]

    @property
    def done(self) -> bool:
        return all(e.phase == Phase.DONE for e in self.executions)


class RealExecution:
    """ExecutionView of one rollout plus its agent state (see the module docstring)."""

    def __init__(self, exec_id: int, group: RealGroup, cfg: T.TaskConfig, rng: np.random.Generator) -> None:
        self.id = exec_id
        self.group_id = group.id
        self.task_id = group.task_id
        self.group = group
        self.cfg = cfg
        self.rng = rng
        self.cursor = None  # gyre.trajectory Execution, opened at start
        self.ctx: list[int] = []
        self.engine = None
        self.phase = Phase.QUEUED
        self.first_version: int | None = None
        self.started_at: float | None = None
        self.deadline_at = float("inf")
        self.turns = 0
        self.retries = 0
        self.handle = Handle(f"exec{exec_id}")
        self.migrate_to = None
        self.migrate_handle: Handle | None = None
        self.finished_at: float | None = None
        self.truncated = False
        self.generated = 0
        self.env_tokens = 0  # tool-output (and sub-agent marker) tokens appended to its trajectory
        self.vsum = 0  # sum over generated tokens of their generating version
        self.reward: float | None = None
        self.inflight = None  # the pending request (Generate or Tool), re-issued after a fault
        self._sub = None
        self._subs = 0
        self._boundary = None  # (recorder point, context length) before the last main segment
        self.segs: list[dict] = []  # per model segment: gen tokens, kv (context) at its start, tool_s after it
        self.branch_marks: list[tuple[int, str]] = []  # (segment index, compact | subagent | retry)

    # --- ExecutionView ---
    @property
    def engine_id(self) -> int | None:
        return None if self.engine is None else self.engine.id

    @property
    def turns_done(self) -> int:
        return self.turns

    @property
    def context_tokens(self) -> int:
        return len(self.ctx)

    @property
    def trajectory_tokens(self) -> int:
        """Prompt, generated and tool-output tokens so far (its trajectory tree's tokens, the prompt once)."""
        return len(self.group.spec.prompt) + self.generated + self.env_tokens

    # --- agent loop ---
    def start(self, now: float) -> Generate:
        self.cursor = self.group.recorder.start()
        self.ctx = list(self.group.spec.prompt)
        self.started_at = now
        self.deadline_at = now + self.cfg.deadline_s
        return self._main_turn()

    def _main_turn(self) -> Generate:
        self._boundary = (self.cursor.point, len(self.ctx))
        self.segs.append({"gen": 0, "kv": len(self.ctx)})
        return Generate(str(self.id), list(self.ctx), self.cfg.max_new_tokens)

    def on_generated(self, tokens: list[int], logprobs: list[float], version: int, now: float):
        if not tokens:
            raise RuntimeError(f"execution {self.id}: engine returned an empty segment")
        self.generated += len(tokens)
        self.vsum += len(tokens) * version  # per-token lag: the version that generated each token
        self.segs[-1]["gen"] = len(tokens)
        if self.first_version is None or version < self.first_version:
            self.first_version = version
        kind, arg = T.parse_action(tokens)
        if self._sub is not None:  # the sub-agent's single turn
            self._sub.append_model(np.asarray(tokens, np.int64), np.asarray(logprobs), version)
            if kind == "lookup":
                return Tool(T.plan_lookup(self.group.spec, self.cfg, self.rng))
            return self.on_tool([T.ERR, T.SEP], now)
        self.cursor.append_model(np.asarray(tokens, np.int64), np.asarray(logprobs), version)
        self.ctx += tokens
        self.turns += 1
        if kind == "answer":
            seen = T.seen_secret(self.ctx, self.group.spec.secret)
            self.reward = T.answer_reward(arg, self.group.spec.secret, seen, self.cfg)
            self.cursor.finish(self.reward)
            return Done(truncated=False)
        if kind == "lookup":
            return Tool(T.plan_lookup(self.group.spec, self.cfg, self.rng))
        if kind == "delegate":
            self._sub = self.cursor.fork()
            self._sub.append_env(np.asarray([T.SUB], np.int64))
            self._subs += 1
            self.branch_marks.append((len(self.segs), "subagent"))
            self.segs.append({"gen": 0, "kv": len(self.ctx) + 1})
            return Generate(f"{self.id}.sub{self._subs}", self.ctx + [T.SUB], self.cfg.max_new_tokens)
        return self._after_tool([T.ERR, T.SEP], now)

    def on_tool(self, out: list[int], now: float):
        self.env_tokens += len(out)
        if self._sub is not None:
            self._sub.append_env(np.asarray(out, np.int64))
            self._sub.close()
            self._sub = None
            return self._after_tool(out, now)
        if out[0] == T.ERR and self.retries < self.cfg.max_retries:
            self.retries += 1  # roll back to before the failed call; the attempt stays as a branch
            point, n = self._boundary
            self.cursor.retry(point)
            self.ctx = self.ctx[:n]
            self.branch_marks.append((len(self.segs), "retry"))
            return self._boundary_check(now) or self._main_turn()
        return self._after_tool(out, now)

    def _after_tool(self, out: list[int], now: float):
        self.cursor.append_env(np.asarray(out, np.int64))
        self.ctx += out
        done = self._boundary_check(now)
        if done is not None:
            return done
        if len(self.ctx) > self.cfg.context_limit:
            seen = T.seen_secret(self.ctx, self.group.spec.secret)
            new = T.compacted(self.group.spec, seen)
            self.cursor.compact(np.asarray(new, np.int64))
            self.ctx = new
            self.branch_marks.append((len(self.segs), "compact"))
        return self._main_turn()

    def _boundary_check(self, now: float) -> Done | None:
        if self.turns >= self.cfg.max_turns or now >= self.deadline_at:
            self.reward = T.partial_credit(self.ctx, self.group.spec.secret, self.cfg)
            self.cursor.hit_deadline()
            return Done(truncated=True, end=1 if self.turns >= self.cfg.max_turns else 2)
        return None

    def __repr__(self) -> str:
        return f"<real exec {self.id} {self.phase.name} turns={self.turns} engine={self.engine_id}>"


class AgentTask:
    """The built-in agent task (gyre.real.task) behind the task contract (gyre.real.task_api.Task).

    Task seeds and keys come from one generator seeded with the run's seed, drawn in group order."""

    stop = [T.SEP]

    def __init__(self, config: T.TaskConfig, seed: int) -> None:
        self.cfg = config
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def new_group(self, group_id: int, first_exec_id: int, size: int) -> RealGroup:
        return RealGroup(group_id, T.make_task(group_id, self.rng), size, first_exec_id, self.cfg, self.seed)

    def score(self, group: RealGroup) -> list[Score]:
        secret = group.spec.secret
        return score_group(group.recorder, lambda st: T.partial_credit(st.context_tokens, secret, self.cfg))
