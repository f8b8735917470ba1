"""Partial credit and group-relative advantages for one task's executions (a GRPO group).

What it models: an execution that finished keeps the reward it reported; one that hit its deadline is not
thrown away but scored by a reward function on the `ReachedState` it reached, flagged truncated, and kept
in its group's baseline. Advantages are GRPO-style: reward minus the group mean, optionally divided by the
group standard deviation. Every branch of an execution (sub-agents, retries, compacted contexts) gets the
execution's advantage.

Evaluation outcomes (`Score.outcome`, the paper's rules): "valid" is a score (a truncated one is a harness
timeout: still scored, by partial credit); "placeholder" is the reward 0 inserted when nothing was evaluable
(it stays in the group as a 0); "failed" is an evaluation that failed (the verifier retries it within a budget,
gyre.real.verify; one still failed after it leaves training); "overall_timeout" is an execution past the overall
limit (dropped, never scored). The group's *members* are its valid and placeholder executions; advantages are
computed over the members only (mean, and std, over them). With fewer than `AdvantageConfig.min_members`
members (default 2: no baseline is left to compare with) the whole group leaves training. An execution that
leaves training gets a NaN advantage, which gyre.trajectory.pack reads as "train none of its branches".

Simplifications: one scalar reward per execution (no per-turn rewards); the baseline is the plain mean over
the members, truncated executions included with their partial credit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gyre.trajectory.record import ReachedState, TaskRecorder


OUTCOMES = ("valid", "placeholder", "failed", "overall_timeout")
MEMBER_OUTCOMES = ("valid", "placeholder")  # the outcomes that stay in their group (the others leave training)


@dataclass(kw_only=True, frozen=True)
class Score:
    """The scored result of one execution (`outcome`: one of OUTCOMES; `reward` counts for members only)."""

    execution: int
    reward: float
    truncated: bool
    outcome: str = "valid"

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"Score.outcome of execution {self.execution} must be one of {OUTCOMES}, "
                             f"got {self.outcome!r}")


@dataclass(kw_only=True, frozen=True)
class AdvantageConfig:
    """GRPO advantage options: divide by the group std (plus eps) or not; the fewest members a group trains with."""

    normalize_std: bool = False
    eps: float = 1e-6
    min_members: int = 2

    def __post_init__(self) -> None:
        if self.min_members < 1:
            raise ValueError(f"AdvantageConfig.min_members must be >= 1, got {self.min_members}")


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
    """Advantage per execution id: reward minus the mean over the group's members (truncated included); NaN for
    an execution that left training, and for all of a group with fewer than `min_members` members."""
    cfg = config or AdvantageConfig()
    if not outcomes:
        return np.zeros(0, np.float64)
    ids = np.array([o.execution for o in outcomes])
    if not np.array_equal(np.sort(ids), np.arange(len(outcomes))):
        raise ValueError(f"outcomes must cover execution ids 0..{len(outcomes) - 1} exactly once, got {ids.tolist()}")
    rewards = np.empty(len(outcomes), np.float64)
    rewards[ids] = [o.reward for o in outcomes]
    member = np.zeros(len(outcomes), bool)
    member[ids] = [o.outcome in MEMBER_OUTCOMES for o in outcomes]
    if member.all():  # every execution scored: the plain group rule
        adv = rewards - rewards.mean()
        if cfg.normalize_std:
            adv = adv / (rewards.std() + cfg.eps)
        return adv
    adv = np.full(len(outcomes), np.nan)
    if member.sum() < cfg.min_members:
        return adv  # too few left for a baseline: the group leaves training
    r = rewards[member]
    adv[member] = r - r.mean()
    if cfg.normalize_std:
        adv[member] /= r.std() + cfg.eps
    return adv
