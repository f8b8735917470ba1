"""Rollout-length predictors: how long will a group's longest rollout be, from what the cluster has shown?

A predictor reads observations only, never an ExecutionSpec: the task id of a group (gyre.cluster.Group),
the turns each finished execution ran (`ExecutionView.turns_done` when its handle completes), and the
live executions' progress (`turns_done` of the siblings still running). Its unit is turns, the length a
policy can observe; a group's prediction is the turns of its longest execution.

- `none`: no opinion (every group scores the same, so ordered admission keeps the drawn order);
- `history`: a recurring task's earlier groups. The log-turns of each finished group are averaged (the
  group's mean of log(turns + 1)) and kept per task; a task's estimate weighs its epochs by recency
  (each older epoch half the weight of the next). A task never seen scores the mean over every finished
  group, so unknown tasks sit between the known long and known short ones;
- `history+siblings`: as `history`, but a task whose latest group is still running also counts that
  group's evidence: finished siblings' turns and running siblings' turns so far (a lower bound); the
  estimate is raised to that evidence where it is larger.

The prediction of a group's longest execution is exp(estimate) x the mean ratio, over finished groups,
of a group's longest turns to its geometric-mean turns (a scale factor: it does not change the order).

`Quality` scores a run's predictions against what then happened: Spearman rank correlation of predicted
and observed longest turns per group, and the share of the observed longest 5% of groups that were in
the predicted top 5% (ties broken by drawn order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gyre.cluster import ExecutionView, Group, Phase

RECENCY = 0.5  # weight of each older epoch relative to the next, in a task's estimate


class Predictor:
    """No opinion: every group scores 0 (drawn order). The base of the others: keeps the observations."""

    name = "none"

    def __init__(self) -> None:
        self.task_hist: dict[int, list[float]] = {}  # task -> mean log(turns + 1) of each finished group, oldest first
        self.live: dict[int, tuple[int, list]] = {}  # group id -> (task, its executions), admitted, unfinished
        self.latest: dict[int, int] = {}  # task -> id of its latest admitted group
        self.done_logs: dict[int, list[float]] = {}  # group id -> log(turns + 1) of its finished executions
        self.sum_mean = 0.0  # over finished groups: sum of mean log-turns, and of log(max / geometric mean)
        self.sum_ratio = 0.0
        self.n_groups = 0

    # ---------------------------------------------------------------- observations
    def admitted(self, group: Group) -> None:
        self.live[group.id] = (group.task_id, list(group.executions))
        self.latest[group.task_id] = group.id
        self.done_logs[group.id] = []

    def finished(self, group_id: int, x: ExecutionView) -> None:
        """An execution of an admitted group ended; when the group is complete its mean joins its task's history."""
        logs = self.done_logs[group_id]
        logs.append(math.log(x.turns_done + 1))
        task, execs = self.live[group_id]
        if len(logs) == len(execs):
            m = float(np.mean(logs))
            self.task_hist.setdefault(task, []).append(m)
            self.sum_mean += m
            self.sum_ratio += max(logs) - m
            self.n_groups += 1
            del self.live[group_id], self.done_logs[group_id]

    # ---------------------------------------------------------------- predictions
    def estimate(self, task: int) -> float | None:
        """A task's expected log-turns, or None without an opinion."""
        return None

    def group(self, group: Group) -> float:
        """Predicted turns of the group's longest execution (0: no opinion)."""
        est = self.estimate(group.task_id)
        if est is None:
            return 0.0
        ratio = self.sum_ratio / self.n_groups if self.n_groups else 0.0
        return math.exp(est + ratio)


class History(Predictor):
    name = "history"

    def estimate(self, task: int) -> float | None:
        hist = self.task_hist.get(task)
        if not hist:
            return self.sum_mean / self.n_groups if self.n_groups else None
        w = RECENCY ** np.arange(len(hist))[::-1]
        return float(np.dot(w, hist) / w.sum())


class HistorySiblings(History):
    name = "history+siblings"

    def estimate(self, task: int) -> float | None:
        est = super().estimate(task)
        gid = self.latest.get(task)
        if gid is None or gid not in self.live:
            return est
        _, execs = self.live[gid]
        finished = self.done_logs[gid]
        running = [math.log(x.turns_done + 1) for x in execs if x.phase != Phase.DONE]
        seen = finished + running  # every sibling's turns so far: a lower bound on its length
        if not seen:
            return est
        low = float(np.mean(seen))
        return low if est is None else max(est, low)


PREDICTORS: dict[str, type[Predictor]] = {p.name: p for p in (Predictor, History, HistorySiblings)}


def make_predictor(name: str) -> Predictor:
    try:
        return PREDICTORS[name]()
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}") from None


# ---------------------------------------------------------------------- quality


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties averaged."""
    s = np.sort(a)
    u, inv = np.unique(a, return_inverse=True)
    lo, hi = np.searchsorted(s, u, "left"), np.searchsorted(s, u, "right")
    return ((lo + hi - 1) / 2.0)[inv]


def spearman(pred: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman rank correlation (NaN when either side is constant)."""
    p, a = _ranks(np.asarray(pred, float)), _ranks(np.asarray(actual, float))
    if len(p) < 2 or p.std() == 0 or a.std() == 0:
        return float("nan")
    return float(np.corrcoef(p, a)[0, 1])


def top_share(pred: Sequence[float], actual: Sequence[float], q: float = 0.05) -> float:
    """Share of the longest q of groups (by actual) that are in the predicted top q; ties by position (NaN
    when every actual length is the same: no longest to find)."""
    n = len(pred)
    if n == 0 or np.ptp(np.asarray(actual, float)) == 0:
        return float("nan")
    k = max(1, math.ceil(q * n))
    idx = np.arange(n)
    top_a = set(np.lexsort((idx, -np.asarray(actual, float)))[:k].tolist())
    top_p = set(np.lexsort((idx, -np.asarray(pred, float)))[:k].tolist())
    return len(top_a & top_p) / k


class Quality:
    """Predicted vs observed longest turns per group, in admission order."""

    def __init__(self) -> None:
        self.pred: dict[int, float] = {}
        self.actual: dict[int, float] = {}

    def predicted(self, group_id: int, turns: float) -> None:
        self.pred[group_id] = turns

    def observed(self, group_id: int, turns: float) -> None:
        self.actual[group_id] = turns

    def summary(self) -> dict[str, float]:
        ids = [g for g in self.pred if g in self.actual]
        p, a = [self.pred[g] for g in ids], [self.actual[g] for g in ids]
        return {"groups": len(ids), "spearman": spearman(p, a), "top5_share": top_share(p, a)}
