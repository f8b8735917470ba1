"""Rewards computed off the driver: a finished group's `score` runs on the tool workers while rollouts go on.

What it models: scoring a group may be real work (running tests, a reward model, a judge) that is slow, raises,
hangs, or loses the process running it. When the last episode of a group finishes, `Verifier.start` sends
`Verify(task, group)` (the task's `score(group)`, run on a copy of both) to the tool service (gyre.real.tools:
bounded concurrency, a timeout and retries per call, a lost worker replaced), so a group is scored while the
other groups still roll out; the trainer awaits its batch's scores (`Verifier.when`) and a step is enqueued
only once every group of it is scored, in the order the steps were asked for.

Evaluation outcomes (gyre.trajectory.credit.Score.outcome): a scoring that fails (the call raised, hung past the
tool timeout, or lost its worker on every attempt) fails every execution of the group; a task may also fail
single executions (`outcome="failed"`), report a placeholder 0 where nothing was evaluable, or an overall
timeout. Failed executions are evaluated again, up to `retries` more times (ToolConfig.eval_retries): each
retry sends the group's scoring again and takes, per execution, the first outcome that did not fail. Once the
budget is spent, a task's optional `score_failed(group, message)` scores what still failed (its own rule), else
those executions stay "failed" and leave training (gyre.trajectory.credit.group_advantages: the group's
advantages are over the members left, and a group left with fewer than 2 leaves training). The log: `verify`
when a group's scoring is sent, `score_retry` (the group, the attempt, the failed executions and why) per
retry, `score_error` (the group, its task and why) when the budget is spent with failures, and `scored` (its
rewards, its outcomes, the seconds it took) once it is back for good.

Simplifications: `score` must be a pure function of the task and the group (it runs on a copy); the group is
pickled to the worker once per scoring (a text task's tokenizer travels as its folder's path, gyre.real.chat); a
user's task class travels with its own module's code (cloudpickle by value), what that module imports must be
importable on the workers.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from gyre.real.task_api import ToolError
from gyre.trajectory import Score
from gyre.trajectory.credit import OUTCOMES


@dataclass(frozen=True)
class Verify:
    """The remote call: `task.score(group)` on a tool worker (blocking: a worker thread)."""

    task: Any
    group: Any

    def run(self) -> list[Score]:
        return list(self.task.score(self.group))


def _truncated(group, e: int) -> bool:
    return group.recorder.executions[e].status == "truncated"


def outcome_counts(log) -> dict[str, int]:
    """The run's evaluation outcomes, counted from its `scored`, `score_retry` and `group_left` notes (summary.csv):
    every scored execution in exactly one of eval_valid (harness timeouts among them: eval_harness_timeouts),
    eval_placeholder, eval_failed (left training once its retries were spent) and eval_overall_timeout."""
    out = {f"eval_{o}": 0 for o in OUTCOMES}
    out.update(eval_harness_timeouts=0, eval_retries=0, groups_left_training=0, executions_left_training=0)
    for rec in log:
        if rec[0] != "note":
            continue
        if rec[2] == "scored" and "outcomes" in rec[3]:
            for o, t in zip(rec[3]["outcomes"], rec[3]["truncated"]):
                out[f"eval_{o}"] += 1
                out["eval_harness_timeouts"] += int(t and o == "valid")
        elif rec[2] == "score_retry":
            out["eval_retries"] += 1
        elif rec[2] == "group_left":
            out["groups_left_training"] += int(rec[3]["whole"])
            out["executions_left_training"] += len(rec[3]["executions"])
    return out


class Verifier:
    """The driver's side: which groups are scored, and the train steps waiting for them."""

    def __init__(self, task, tools, log: Callable[[str, dict], None], now: Callable[[], float],
                 retries: int = 1) -> None:
        if retries < 0:
            raise ValueError(f"ToolConfig.eval_retries must be >= 0, got {retries}")
        self.task, self.tools, self._log, self._now, self.retries = task, tools, log, now, retries
        mod = sys.modules.get(type(task).__module__)
        if mod is not None and not mod.__name__.startswith("gyre."):  # a user's task travels with its module's code:
            ray.cloudpickle.register_pickle_by_value(mod)  # a script or test module need not be importable on workers
        self.scores: dict[int, list[Score]] = {}  # group id -> its scores, once back
        self._waits: deque[tuple[list[int], Callable[[list[list[Score]]], None]]] = deque()
        self._each: dict[int, Callable[[list[Score]], None]] = {}  # group id -> called once it alone is scored

    def start(self, grp) -> None:
        """Score `grp` (a gyre.real.execution.RealGroup whose executions all finished) on the tool service."""
        self._log("verify", {"group": grp.id, "task": grp.task_id})
        self._send(grp, self._now(), 0, {})

    def _send(self, grp, t0: float, attempt: int, got: dict[int, Score]) -> None:
        self.tools.call(Verify(self.task, grp.env), lambda out: self._back(grp, out, t0, attempt, got))

    def _back(self, grp, out, t0: float, attempt: int, got: dict[int, Score]) -> None:
        ids = [ex.id for ex in grp.env.recorder.executions]
        if isinstance(out, ToolError):
            message = out.message
        else:
            message = "the task scored it failed"
            for sc in out:
                if sc.execution not in got or got[sc.execution].outcome == "failed":
                    got[sc.execution] = sc
        failed = [e for e in ids if e not in got or got[e].outcome == "failed"]
        if failed and attempt < self.retries:
            self._log("score_retry", {"group": grp.id, "attempt": attempt + 1, "failed": failed, "message": message})
            self._send(grp, t0, attempt + 1, got)
            return
        if failed:
            self._log("score_error", {"group": grp.id, "task": grp.task_id, "message": message, "failed": failed})
            rule = getattr(self.task, "score_failed", None)
            if rule is not None:
                for sc in rule(grp.env, message):
                    if sc.execution in failed:
                        got[sc.execution] = sc
            for e in failed:
                if e not in got or got[e].outcome == "failed":
                    got[e] = Score(execution=e, reward=0.0, truncated=_truncated(grp.env, e), outcome="failed")
        scores = [got[e] for e in ids]
        self._log("scored", {"group": grp.id, "rewards": [s.reward for s in scores],
                             "outcomes": [s.outcome for s in scores], "truncated": [s.truncated for s in scores],
                             "attempts": attempt + 1, "verify_s": self._now() - t0})
        fn = self._each.pop(grp.id, None)
        if fn is not None:  # a group released alone (on_scored)
            fn(list(scores))
            return
        self.scores[grp.id] = scores
        self._release()

    def when(self, groups: Sequence, fn: Callable[[list[list[Score]]], None]) -> None:
        """Call `fn(scores of each group)` once every group is scored, after the waits asked before this one."""
        self._waits.append(([g.id for g in groups], fn))
        self._release()

    def on_scored(self, group, fn: Callable[[list[Score]], None]) -> None:
        """Call `fn(its scores)` once `group` is scored (now, if it is), whatever other groups wait for: a streaming
        step (gyre.real.streaming) trains each group as it is ready."""
        if group.id in self.scores:
            fn(self.scores.pop(group.id))
        else:
            self._each[group.id] = fn

    def _release(self) -> None:
        while self._waits and all(g in self.scores for g in self._waits[0][0]):
            ids, fn = self._waits.popleft()
            fn([self.scores.pop(g) for g in ids])
