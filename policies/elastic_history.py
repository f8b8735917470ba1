"""What the elastic controller has observed, and the spread of remaining times it draws from.

Observations only: each finished execution's segment count, seconds per segment, mean context and
duration from first run to finish (`Records`, fed by the train loop's finish hook); the live executions'
progress, as censored data (`History.live_done`, `Spread`'s live ages). Nothing here sees a future length.

A live execution's remaining time is drawn, not averaged: a batch is ready when the last of its
executions finishes, and the largest of a batch's predicted finishes is its true last finish only if each
prediction carries the spread the finishes have (at each one's mean, a batch of 1,024 short-math
rollouts is predicted ready at its mean, ~50 s early). So each execution has a fixed quantile level
(`level`: equidistributed over consecutive ids, so the executions of a batch cover (0, 1) evenly) and its
remaining time is that quantile of its conditional distribution given what it has done:
- once it has finished a segment, its remaining segments from the Kaplan-Meier segment distribution
  (`History.draw_segments`) times its own seconds per segment;
- before that (a single-turn rollout has nothing else), its duration from the Kaplan-Meier distribution of
  durations, finished ones events and live ones censored at their ages, conditional on its age
  (`Spread.remaining`), times its engine's step time now over the one the durations were measured at.
A level that falls past the largest observation (the tail no execution has yet shown) takes the tail's
mean instead, in both distributions: a Pareto of index 1 + 1 / `unseen_residual`, whose mean residual life
is `unseen_residual` times the age it is reached at (its extreme quantiles would put a batch's last finish
at ten times the longest seen when most executions are still running, as at the first step, while a
generation cap bounds a single-turn rollout).

Simplifications: a duration measured at one engine load is rescaled to another by the ratio of engine
step times (a decoding sequence gains one token per step); ties in durations are events in input order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gyre.cluster import ExecutionView

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # the golden-ratio sequence i x 0.618... mod 1 is the most even of its kind


def level(execution_id: int) -> float:
    """The quantile level an execution's remaining time is drawn at: fixed for its life (one sampled future
    per run, the same for every candidate the controller compares), in (0, 1), even over consecutive ids."""
    u = (execution_id * GOLDEN + 0.5 * GOLDEN) % 1.0
    return min(max(u, 1e-6), 1.0 - 1e-6)


@dataclass(frozen=True)
class History:
    """What finished executions showed (observations only), and the live ones' progress as censored data."""

    segments: tuple[int, ...] = ()  # segments of each finished execution, sorted
    seg_s: float = 0.0  # mean seconds per segment over finished executions
    ctx: float = 0.0  # mean context over a finished execution's life: half its trajectory tokens (it grows ~linearly)
    live_done: tuple[int, ...] = ()  # segments each live execution has completed (it has more to come)

    def survival(self) -> list[float]:
        """Kaplan-Meier P(segments > k) for k = 0 .. the largest observation: finished executions are events
        at their segment counts, live ones censored at what they have done (so the long ones, which finish
        last, are not missing from the estimate). Computed once per History."""
        sv = self.__dict__.get("_sv")
        if sv is not None:
            return sv
        top = max(self.segments[-1] if self.segments else 0, max(self.live_done, default=0))
        ends = [0] * (top + 2)
        cens = [0] * (top + 2)
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

    def _s_at(self, t: float, unseen_residual: float) -> float:
        sv = self.survival()
        top = len(sv) - 1
        if t <= top:
            return sv[int(t)]
        return sv[top] * (max(top, 1) / t) ** (1.0 + 1.0 / unseen_residual)

    def p_more(self, done: int, k: float, unseen_residual: float) -> float:
        """P(segments > k | segments > done), k >= done (the module docstring's tail past the observations)."""
        base = self._s_at(done, unseen_residual)
        return self._s_at(k, unseen_residual) / base if base > 0 else 1.0

    def residual_segments(self, done: int, unseen_residual: float) -> float:
        """Expected segments still to come (the current one included) for an execution `done` segments in:
        sum over k >= done of P(segments > k) / P(segments > done); past the largest observation the
        tail still alive is expected to last `unseen_residual` times its age."""
        surv = self.__dict__.get("_suffix")
        sv = self.survival()
        if surv is None:
            surv = [0.0] * (len(sv) + 1)
            for k in range(len(sv) - 1, -1, -1):
                surv[k] = surv[k + 1] + sv[k]
            object.__setattr__(self, "_suffix", surv)
        top = len(sv) - 1
        if done > top or sv[done] <= 0:
            return unseen_residual * max(done, 1)
        tail = sv[top] * unseen_residual * max(top, 1)
        return (surv[done] + tail) / sv[done]

    def draw_segments(self, done: int, u: float, unseen_residual: float) -> int:
        """Segments still to come (the current one included) at quantile level u of the conditional
        distribution: T - done for the least T > done with P(segments > T | segments > done) <= 1 - u."""
        sv = self.survival()
        base = self._s_at(done, unseen_residual)
        if base <= 0:
            return max(1, math.ceil(unseen_residual * max(done, 1)))
        target = base * (1.0 - u)
        top = len(sv) - 1
        if done + 1 <= top and sv[top] <= target:
            lo, hi = done + 1, top  # sv is non-increasing: the first k in [lo, hi] with sv[k] <= target
            while lo < hi:
                mid = (lo + hi) // 2
                if sv[mid] <= target:
                    hi = mid
                else:
                    lo = mid + 1
            return lo - done
        return max(1, math.ceil((1.0 + unseen_residual) * max(top, done, 1)) - done)  # the tail's mean


class Spread:
    """The Kaplan-Meier distribution of execution durations (seconds from first run to finish): finished
    executions are events, live ones censored at their ages. Sorted once; each query is a binary search.

    The estimate is the product, over the marks in time order (events before censorings at a tie), of
    1 - 1 / (marks not yet passed) at each event; it is taken with numpy's running product, which multiplies
    in order, so it equals the loop over the marks bit for bit."""

    def __init__(self, durations: Iterable[float], live_ages: Iterable[float], unseen_residual: float) -> None:
        d = np.fromiter(durations, dtype=float)
        t = np.concatenate([d, np.fromiter(live_ages, dtype=float)])
        censored = np.arange(len(t)) >= len(d)
        order = np.lexsort((censored, t))  # by time, events first at a tie
        event = ~censored[order]
        at_risk = len(t) - np.flatnonzero(event)  # marks not yet passed at each event
        self.times: list[float] = t[order][event].tolist()  # event times, ascending
        self.neg_s: list[float] = (-np.multiply.accumulate(1.0 - 1.0 / at_risk)).tolist()  # minus the survival
        # just after each event (ascending, for bisect)
        self.r = unseen_residual

    def __bool__(self) -> bool:
        return bool(self.times)

    def survival(self, t: float) -> float:
        """P(duration > t)."""
        i = bisect.bisect_right(self.times, t)
        if i < len(self.times) or not self.times:
            return 1.0 if i == 0 else -self.neg_s[i - 1]
        top, s_top = self.times[-1], -self.neg_s[-1]
        return s_top * (top / max(t, 1e-12)) ** (1.0 + 1.0 / self.r) if t > top else s_top

    def remaining(self, age: float, u: float) -> float:
        """Seconds still to run, at quantile level u, for an execution that has run `age` seconds."""
        base = self.survival(age)
        if base <= 0:
            return self.r * age
        target = base * (1.0 - u)
        i = bisect.bisect_left(self.neg_s, -target, lo=bisect.bisect_right(self.times, age))
        if i < len(self.times):
            return self.times[i] - age
        return (1.0 + self.r) * max(self.times[-1], age) - age  # the tail's mean


class Records:
    """The controller's records of finished executions (fed one at a time by `finished`) and of groups."""

    def __init__(self) -> None:
        self.segs: list[int] = []  # segments of each finished execution
        self.ctx: list[float] = []  # its mean context over its life
        self.seg_s: list[float] = []  # its seconds per segment
        # its seconds from first run to finish, keyed by (first run, id): kept in start order, a sample of
        # the lengths independent of them (in finish order the first are the shortest, and cycling those
        # over a batch's queued executions would predict its last finish far too soon)
        self.started_durations: list[tuple[float, int, float]] = []
        self.group_size = 1  # executions per group (as the groups admitted show)
        self.seen_step = [0.0, 0]  # sum and count of the mean engine step time sampled at finishes
        self.max_ctx = 0  # the largest context seen on a live execution (what compaction bounds contexts at)
        self.last_counts = (0.0, 0.0)  # the last batch's trained tokens and attention sum
        self._segs_sorted: list[int] = []  # `segs`, sorted (kept as they come: History wants them sorted)

    FIELDS = ("segs", "ctx", "seg_s", "started_durations", "group_size", "seen_step", "last_counts", "max_ctx")

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
        """What finished executions took, in the order they started (see `started_durations`)."""
        return [d for _, _, d in self.started_durations]

    def sample_step(self, step_s: float) -> None:
        """The mean engine step time as an execution finishes: the load its duration was measured at."""
        self.seen_step[0] += step_s
        self.seen_step[1] += 1

    @property
    def seen(self) -> float:
        return self.seen_step[0] / max(self.seen_step[1], 1)

    def history(self, live: Sequence[ExecutionView]) -> History:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return History(segments=tuple(self._segs_sorted), seg_s=mean(self.seg_s), ctx=mean(self.ctx),
                       live_done=tuple(x.turns_done for x in live))

    def spread(self, live: Sequence[ExecutionView], now: float, unseen_residual: float) -> Spread:
        ages = [now - x.started_at for x in live if x.started_at is not None]
        return Spread((d for _, _, d in self.started_durations), ages, unseen_residual)


def drawn_remaining_s(x: ExecutionView, hist: History, spread: Spread, now: float, unseen_residual: float,
                      load: float = 1.0) -> float | None:
    """A live execution's remaining seconds at its quantile level (`level`; the module docstring): once it
    has finished a segment, drawn remaining segments at its own pace; before that, its drawn duration
    given its age, times `load` (its engine's step time now over the one the durations were measured at).
    None when nothing has finished yet (no spread to draw from)."""
    u = level(x.id)
    if x.turns_done >= 1 and x.started_at is not None:
        return hist.draw_segments(x.turns_done, u, unseen_residual) * (now - x.started_at) / x.turns_done
    if not spread:
        return None
    age = now - x.started_at if x.started_at is not None else 0.0
    return spread.remaining(age, u) * load
