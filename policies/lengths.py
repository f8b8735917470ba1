"""Rollout lengths as observed: the records of finished executions (`Records`) and Kaplan-Meier estimates from
them, finished executions as events and live ones censored at their progress (so the long ones, which finish
last, are not missing from the estimate).

`History` holds segment counts, `Durations` seconds from first run to finish. Past the largest observation the
tail is a Pareto of index 1 + 1 / r, whose mean residual life is r times the age it is reached at (`r`: the
caller's `unseen_residual`); a quantile there takes the tail's mean instead, since its extreme quantiles would
put a batch's last finish at ten times the longest seen. `level` gives each execution a fixed quantile level,
even over consecutive ids, so a batch's draws cover (0, 1) and its largest is its last finish, not its mean.
Used by policies.elastic (docs/elastic.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gyre.cluster import ExecutionView

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # i x 0.618... mod 1 covers (0, 1) most evenly


def level(execution_id: int) -> float:
    """The quantile level an execution's remaining time is drawn at: fixed for its life, even over ids."""
    u = (execution_id * GOLDEN + 0.5 * GOLDEN) % 1.0
    return min(max(u, 1e-6), 1.0 - 1e-6)


@dataclass(frozen=True)
class History:
    """Segments of finished executions (events) and of live ones so far (censored)."""

    segments: tuple[int, ...] = ()  # segments of each finished execution, sorted
    seg_s: float = 0.0  # mean seconds per segment over finished executions
    ctx: float = 0.0  # mean context over a finished execution's life (half its trajectory tokens)
    live_done: tuple[int, ...] = ()  # segments each live execution has completed

    def survival(self) -> list[float]:
        """Kaplan-Meier P(segments > k), k = 0 .. the largest observation (computed once)."""
        sv = self.__dict__.get("_sv")
        if sv is not None:
            return sv
        top = max(self.segments[-1] if self.segments else 0, max(self.live_done, default=0))
        ends, cens = [0] * (top + 2), [0] * (top + 2)
        for t in self.segments:
            ends[t] += 1
        for d in self.live_done:
            cens[d] += 1
        at_risk = len(self.segments) + len(self.live_done)
        s, sv = 1.0, []
        for k in range(top + 1):
            if at_risk > 0 and ends[k]:
                s *= 1.0 - ends[k] / at_risk
            at_risk -= ends[k] + cens[k]
            sv.append(s)
        object.__setattr__(self, "_sv", sv)
        return sv

    def _s_at(self, t: float, r: float) -> float:
        sv = self.survival()
        top = len(sv) - 1
        return sv[int(t)] if t <= top else sv[top] * (max(top, 1) / t) ** (1.0 + 1.0 / r)

    def p_more(self, done: int, k: float, r: float) -> float:
        """P(segments > k | segments > done), k >= done."""
        base = self._s_at(done, r)
        return self._s_at(k, r) / base if base > 0 else 1.0

    def residual_segments(self, done: int, r: float) -> float:
        """Expected segments still to come (the current one included) after `done`."""
        surv, sv = self.__dict__.get("_suffix"), self.survival()
        if surv is None:
            surv = [0.0] * (len(sv) + 1)
            for k in range(len(sv) - 1, -1, -1):
                surv[k] = surv[k + 1] + sv[k]
            object.__setattr__(self, "_suffix", surv)
        top = len(sv) - 1
        if done > top or sv[done] <= 0:
            return r * max(done, 1)
        return (surv[done] + sv[top] * r * max(top, 1)) / sv[done]

    def draw_segments(self, done: int, u: float, r: float) -> int:
        """Segments still to come at quantile level u: T - done for the least T > done with
        P(segments > T | segments > done) <= 1 - u (past every observation: the tail's mean)."""
        sv, base = self.survival(), self._s_at(done, r)
        if base <= 0:
            return max(1, math.ceil(r * max(done, 1)))
        target, top = base * (1.0 - u), len(sv) - 1
        if done + 1 <= top and sv[top] <= target:
            lo, hi = done + 1, top  # sv is non-increasing: the first k in [lo, hi] with sv[k] <= target
            while lo < hi:
                mid = (lo + hi) // 2
                if sv[mid] <= target:
                    hi = mid
                else:
                    lo = mid + 1
            return lo - done
        return max(1, math.ceil((1.0 + r) * max(top, done, 1)) - done)


class Durations:
    """Kaplan-Meier distribution of durations (first run to finish): finished executions are events, live ones
    censored at their ages (events first at a tie). numpy's running product multiplies in order, so it equals
    the loop over the marks bit for bit."""

    def __init__(self, durations: Iterable[float], live_ages: Iterable[float], unseen_residual: float) -> None:
        d = np.fromiter(durations, dtype=float)
        t = np.concatenate([d, np.fromiter(live_ages, dtype=float)])
        censored = np.arange(len(t)) >= len(d)
        order = np.lexsort((censored, t))
        event = ~censored[order]
        at_risk = len(t) - np.flatnonzero(event)
        self.times: list[float] = t[order][event].tolist()  # event times, ascending
        self.neg_s: list[float] = (-np.multiply.accumulate(1.0 - 1.0 / at_risk)).tolist()  # -S just after each
        self.r = unseen_residual

    def __bool__(self) -> bool:
        return bool(self.times)

    def survival(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t)
        if i < len(self.times) or not self.times:
            return 1.0 if i == 0 else -self.neg_s[i - 1]
        top, s_top = self.times[-1], -self.neg_s[-1]
        return s_top * (top / max(t, 1e-12)) ** (1.0 + 1.0 / self.r) if t > top else s_top

    def remaining(self, age: float, u: float) -> float:
        """Seconds still to run at quantile level u after `age` seconds."""
        base = self.survival(age)
        if base <= 0:
            return self.r * age
        i = bisect.bisect_left(self.neg_s, -base * (1.0 - u), lo=bisect.bisect_right(self.times, age))
        return self.times[i] - age if i < len(self.times) else (1.0 + self.r) * max(self.times[-1], age) - age


class Records:
    """What finished executions showed, fed one at a time (`finished`); `state` is what a resumed run keeps."""

    FIELDS = ("segs", "ctx", "seg_s", "started_durations", "group_size", "seen_step", "last_counts", "max_ctx")

    def __init__(self) -> None:
        self.segs: list[int] = []  # segments of each finished execution
        self.ctx: list[float] = []  # its mean context over its life
        self.seg_s: list[float] = []  # its seconds per segment
        # (first run, id, duration), in start order: in finish order the first are the shortest
        self.started_durations: list[tuple[float, int, float]] = []
        self.group_size = 1  # executions per group
        self.seen_step = [0.0, 0]  # sum and count of the mean engine step time sampled at finishes
        self.max_ctx = 0  # the largest live context seen (what compaction bounds contexts at)
        self.last_counts = (0.0, 0.0)  # the last batch's trained tokens and attention sum (x trained_share)
        self._segs_sorted: list[int] = []

    def state(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def load_state(self, state: dict) -> None:
        for k in self.FIELDS:
            if k in state:
                setattr(self, k, state[k])
        self._segs_sorted = sorted(self.segs)

    def finished(self, x: ExecutionView, group_size: int, now: float) -> None:
        self.group_size = group_size
        segs = x.turns_done + 1
        t0 = x.started_at if x.started_at is not None else now
        self.segs.append(segs)
        bisect.insort(self._segs_sorted, segs)
        self.ctx.append(0.5 * x.trajectory_tokens)
        self.seg_s.append((now - t0) / segs)
        bisect.insort(self.started_durations, (t0, x.id, now - t0))

    def durations(self) -> list[float]:
        return [d for _, _, d in self.started_durations]

    def sample_step(self, step_s: float) -> None:  # the mean engine step as one finishes: its duration's load
        self.seen_step[0] += step_s
        self.seen_step[1] += 1

    @property
    def seen(self) -> float:
        return self.seen_step[0] / max(self.seen_step[1], 1)

    def history(self, live: Sequence[ExecutionView]) -> History:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return History(segments=tuple(self._segs_sorted), seg_s=mean(self.seg_s), ctx=mean(self.ctx),
                       live_done=tuple(x.turns_done for x in live))

    def duration_dist(self, live: Sequence[ExecutionView], now: float, r: float) -> Durations:
        ages = [now - x.started_at for x in live if x.started_at is not None]
        return Durations((d for _, _, d in self.started_durations), ages, r)
