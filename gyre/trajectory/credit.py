"""Partial credit and group-relative advantages for one task's executions (a GRPO group).

What it models: an execution that finished keeps the reward it reported; one that hit its deadline is not
thrown away but scored by a reward function on the `ReachedState` it reached, flagged truncated, and kept
in its group's baseline. Advantages are GRPO-style: reward minus the group mean, optionally divided by the
group standard deviation. Every branch of an execution (sub-agents, retries, compacted contexts) gets the
execution's advantage.

Simplifications: one scalar reward per execution (no per-turn rewards); the baseline is the plain group
mean, truncated executions included with their partial credit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gyre.trajectory.record import ReachedState, TaskRecorder


@dataclass(kw_only=True, frozen=True)
class Score:
    """The scored result of one execution."""

    execution: int
    reward: float
    truncated: bool


@dataclass(kw_only=True, frozen=True)
class AdvantageConfig:
    """GRPO advantage options: divide by the group std (plus eps) or not."""

    normalize_std: bool = False
    eps: float = 1e-6


def score_group(recorder: TaskRecorder, partial_credit: Callable[[ReachedState], float]) -> list[Score]:
    """Outcomes of every execution of the task; truncated ones are scored by `partial_credit`."""
    out = []
    for ex in recorder.executions:
        if ex.status == "running":
            raise ValueError(f"execution {ex.id} of task {recorder.task_id!r} is still running; cannot score it")
        if ex.status == "truncated":
            reward = float(partial_credit(ex.reached_state()))
            if not np.isfinite(reward):
                raise ValueError(f"partial credit for execution {ex.id} of task {recorder.task_id!r} is {reward}")
        else:
            reward = float(ex.reward)
        out.append(Score(execution=ex.id, reward=reward, truncated=ex.status == "truncated"))
    return out


def group_advantages(outcomes: list[Score], config: AdvantageConfig | None = None) -> np.ndarray:
    """Advantage per execution id: reward minus the mean over the whole group (truncated included)."""
    cfg = config or AdvantageConfig()
    if not outcomes:
        return np.zeros(0, np.float64)
    ids = np.array([o.execution for o in outcomes])
    if not np.array_equal(np.sort(ids), np.arange(len(outcomes))):
        raise ValueError(f"outcomes must cover execution ids 0..{len(outcomes) - 1} exactly once, got {ids.tolist()}")
    rewards = np.empty(len(outcomes), np.float64)
    rewards[ids] = [o.reward for o in outcomes]
    adv = rewards - rewards.mean()
    if cfg.normalize_std:
        adv = adv / (rewards.std() + cfg.eps)
    return adv
