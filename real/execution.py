"""One live execution as the real backend drives it: the scheduler's view of a task's episode.

What it models: the backend side of the environment contract (gyre.real.task_api). A `RealGroup` wraps a
task's group and a `RealExecution` one of its episodes: it is the gyre.cluster ExecutionView a policy sees
(phase, engine, turns, context size, versions) plus the driver's bookkeeping (its engine, migration and
parking state, the request in flight), and it measures the rollout's shape for the trace (per model
segment: tokens generated, context at its start, the tool time after it; branches). It forwards every
request of the episode unchanged but for the engine-side sequence id (its KV cache key), and uses nothing
of the task beyond the contract.

The driver owns the context, so an engine only ever holds a cache of it: moving an execution (policy
migration or engine fault) means sending the same request to another engine, which re-prefills it.
"""

from __future__ import annotations

import dataclasses

from gyre.backend import BookedExecution, BookedGroup
from gyre.cluster import Phase
from gyre.handles import Handle
from gyre.real.task_api import Done, Generate


class RealGroup(BookedGroup):
    """One task's GRPO group as the backend books it: group `group_id`, the `index`-th task of the sequence."""

    def __init__(self, group_id: int, index: int, env, first_exec_id: int) -> None:
        self.id = group_id
        self.task_id = index
        self.env = env  # the task's group (gyre.real.task_api.TaskGroup)
        self.prompt_tokens = len(env.prompt)
        self.executions = [RealExecution(first_exec_id + i, self, ep) for i, ep in enumerate(env.episodes)]
        self.start_order: list[int] = []  # execution ids in the order their episodes started

    def recorded_ids(self) -> list[int]:
        """The execution id of each of the recorder's executions, in its order: an episode opens its execution in
        the recorder when it starts (both built-in tasks do), so the i-th one is the i-th started; a task that
        records otherwise is taken in episode order."""
        n = len(self.env.recorder.executions)
        order = self.start_order if len(self.start_order) == n else [x.id for x in self.executions]
        return order[:n]


class RealExecution(BookedExecution):
    """ExecutionView of one rollout, driving its episode (see the module docstring)."""

    def __init__(self, exec_id: int, group: RealGroup, episode) -> None:
        self.id = exec_id
        self.group_id = group.id
        self.task_id = group.task_id
        self.group = group
        self.episode = episode
        self.engine = None
        self.phase = Phase.QUEUED
        self.first_version: int | None = None
        self.started_at: float | None = None
        self.turns = 0
        self.handle = Handle(f"exec{exec_id}")
        self.migrate_to = None
        self.migrate_handle: Handle | None = None
        self.finished_at: float | None = None
        self.truncated = False
        self.end = -1  # the finish code once done
        self.generated = 0
        self.env_tokens = 0  # tool and environment tokens its requests' contexts added (a measure, see trajectory_tokens)
        self._expect: int | None = None  # the last segment's context plus what it generated
        self.vsum = 0  # sum over generated tokens of their generating version
        self.reward: float | None = None  # as the episode reported it at its end (None: only `score` knows)
        self.inflight = None  # the pending request (Generate or Tool), re-issued after a fault
        self.seq_ids: list[str] = [str(exec_id)]  # the engine-side sequences it used (released when it leaves one)
        self._ctx = 0
        self.segs: list[dict] = []  # per model segment: gen tokens, kv (context) at its start, tool_s after it
        self.branch_marks: list[tuple[int, str]] = []  # (segment index, compact | subagent | retry)

    # --- ExecutionView (engine_id: BookedExecution) ---
    @property
    def turns_done(self) -> int:
        return self.turns

    @property
    def context_tokens(self) -> int:
        return self._ctx

    @property
    def deadline_at(self) -> float:
        """When its wall-clock budget ends, as its episode states it (the contract's optional `deadline_at`)."""
        return float(getattr(self.episode, "deadline_at", float("inf")))

    @property
    def trajectory_tokens(self) -> int:
        """Prompt, generated and tool-output tokens so far, measured from its requests: a segment's context beyond
        the previous segment's context and output counts as tool or environment tokens (a compaction's or a
        sub-agent's switch of context adds only what grows)."""
        return self.group.prompt_tokens + self.generated + self.env_tokens

    # --- the episode's requests ---
    def start(self, now: float):
        self.started_at = now
        self.group.start_order.append(self.id)
        return self._request(self.episode.start(now))

    def on_generated(self, tokens: list[int], logprobs: list[float], version: int, now: float):
        if not tokens:
            raise RuntimeError(f"execution {self.id}: engine returned an empty segment")
        self.generated += len(tokens)
        self.vsum += len(tokens) * version  # per-token lag: the version that generated each token
        self.segs[-1]["gen"] = len(tokens)
        self._expect = self._ctx + len(tokens)
        self.turns += 1
        if self.first_version is None or version < self.first_version:
            self.first_version = version
        return self._request(self.episode.on_generated(list(tokens), list(logprobs), version, now))

    def on_generated_all(self, results: list[tuple], now: float):
        """A Generate with parallel segments came back whole: `results` (tokens, logprobs, version, done) per
        segment, the Generate's own first (the contract's optional `on_generated_all`)."""
        if any(not r[0] for r in results):
            raise RuntimeError(f"execution {self.id}: engine returned an empty segment")
        n = sum(len(r[0]) for r in results)
        self.generated += n
        self.vsum += sum(len(r[0]) * r[2] for r in results)
        self.segs[-1]["gen"] = n
        self._expect = self._ctx + len(results[0][0])
        self.turns += 1
        oldest = min(r[2] for r in results)
        if self.first_version is None or oldest < self.first_version:
            self.first_version = oldest
        res = [(list(t), list(lp), int(v), float(d)) for t, lp, v, d in results]
        return self._request(self.episode.on_generated_all(res, now))

    def on_tool(self, result, now: float):
        return self._request(self.episode.on_tool(result, now))

    def _request(self, req):
        if isinstance(req, Generate):
            if req.branch:
                self.branch_marks.append((len(self.segs), req.branch))
            self.segs.append({"gen": 0, "kv": len(req.context)})
            if self._expect is not None:
                self.env_tokens += max(0, len(req.context) - self._expect)
            self._ctx = len(req.context)
            name = self._seq
            if req.parallel:
                seqs = [req.seq] + [g.seq for g in req.parallel]
                if len(set(seqs)) != len(seqs) or any(g.parallel for g in req.parallel):
                    raise RuntimeError(f"execution {self.id}: parallel segments need distinct seq names, got {seqs}")
                self.segs[-1]["kv"] += sum(len(g.context) for g in req.parallel)
                par = tuple(dataclasses.replace(g, seq=name(g.seq)) for g in req.parallel)
                return dataclasses.replace(req, seq=name(req.seq), parallel=par)
            return dataclasses.replace(req, seq=name(req.seq))
        if isinstance(req, Done):
            self.reward, self.end = req.reward, req.end
        return req

    def _seq(self, q: str) -> str:
        """The engine-side id of the episode's sequence `q` (noted, so it is released with the others)."""
        sid = str(self.id) if q == "main" else f"{self.id}.{q}"
        if sid not in self.seq_ids:
            self.seq_ids.append(sid)
        return sid

    def __repr__(self) -> str:
        return f"<real exec {self.id} {self.phase.name} turns={self.turns} engine={self.engine_id}>"
