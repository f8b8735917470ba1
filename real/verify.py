"""Rewards computed off the driver: a finished group's `score` runs on the tool workers while rollouts go on.

What it models: scoring a group may be real work (running tests, a reward model, a judge) that is slow, raises,
hangs, or loses the process running it. When the last episode of a group finishes, `Verifier.start` sends
`Verify(task, group)` (the task's `score(group)`, run on a copy of both) to the tool service (gyre.real.tools:
bounded concurrency, a timeout and retries per call, a lost worker replaced), so a group is scored while the
other groups still roll out; the trainer awaits its batch's scores (`Verifier.when`) and a step is enqueued
only once every group of it is scored, in the order the steps were asked for.

A verification that fails (the call raised, hung past the tool timeout, or lost its worker on every attempt)
scores the group by the task's rule: its optional `score_failed(group, message)` (one Score per episode, or
raise to end the run), else 0 for every episode, truncated or not, so the group has no advantage and neither
rewards nor punishes; the run goes on. The log: a `verify` note when a group's scoring is sent, `scored` (its
rewards and the seconds it took) when it is back, `score_error` (the group, its task and why) when it failed.

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


@dataclass(frozen=True)
class Verify:
    """The remote call: `task.score(group)` on a tool worker (blocking: a worker thread)."""

    task: Any
    group: Any

    def run(self) -> list[Score]:
        return list(self.task.score(self.group))


def zero_scores(group) -> list[Score]:
    """Every episode of `group` scored 0, truncated as its recorder says (the default rule of a failed scoring)."""
    return [Score(execution=ex.id, reward=0.0, truncated=ex.status == "truncated") for ex in group.recorder.executions]


class Verifier:
    """The driver's side: which groups are scored, and the train steps waiting for them."""

    def __init__(self, task, tools, log: Callable[[str, dict], None], now: Callable[[], float]) -> None:
        self.task, self.tools, self._log, self._now = task, tools, log, now
        mod = sys.modules.get(type(task).__module__)
        if mod is not None and not mod.__name__.startswith("gyre."):  # a user's task travels with its module's code:
            ray.cloudpickle.register_pickle_by_value(mod)  # a script or test module need not be importable on workers
        self.scores: dict[int, list[Score]] = {}  # group id -> its scores, once back
        self._waits: deque[tuple[list[int], Callable[[list[list[Score]]], None]]] = deque()
        self._each: dict[int, Callable[[list[Score]], None]] = {}  # group id -> called once it alone is scored

    def start(self, grp) -> None:
        """Score `grp` (a gyre.real.execution.RealGroup whose executions all finished) on the tool service."""
        t0 = self._now()
        self._log("verify", {"group": grp.id, "task": grp.task_id})
        self.tools.call(Verify(self.task, grp.env), lambda out: self._back(grp, out, t0))

    def _back(self, grp, out, t0: float) -> None:
        if isinstance(out, ToolError):
            self._log("score_error", {"group": grp.id, "task": grp.task_id, "message": out.message})
            rule = getattr(self.task, "score_failed", None)
            out = rule(grp.env, out.message) if rule is not None else zero_scores(grp.env)
        self._log("scored", {"group": grp.id, "rewards": [s.reward for s in out], "verify_s": self._now() - t0})
        fn = self._each.pop(grp.id, None)
        if fn is not None:
            fn(list(out))
            return
        self.scores[grp.id] = list(out)
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
