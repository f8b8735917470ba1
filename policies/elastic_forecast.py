"""What the elastic controller observes (`Records`), its predictions of single live executions, and the
snapshot of both every decision reads (`Forecast`). Observations only: nothing here sees a future length.
A live execution's remaining time is drawn at its quantile level (policies.survival.level): remaining segments
at its own pace once it has finished one, before that its duration given its age times its engine's load.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView, Phase
from gyre.policies.survival import Durations, History, level


class Records:
    """The controller's records of finished executions, fed one at a time (`finished`)."""

    FIELDS = ("segs", "ctx", "seg_s", "started_durations", "group_size", "seen_step", "last_counts", "max_ctx")

    def __init__(self) -> None:
        self.segs: list[int] = []  # segments of each finished execution
        self.ctx: list[float] = []  # its mean context over its life
        self.seg_s: list[float] = []  # its seconds per segment
        # (first run, id, duration), in start order: a sample independent of the lengths (in finish order the
        # first are the shortest, which cycled over waiting executions would predict a batch far too soon)
        self.started_durations: list[tuple[float, int, float]] = []
        self.group_size = 1  # executions per group
        self.seen_step = [0.0, 0]  # sum and count of the mean engine step time sampled at finishes
        self.max_ctx = 0  # the largest live context seen (what compaction bounds contexts at)
        self.last_counts = (0.0, 0.0)  # the last batch's trained tokens and attention sum
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

    def duration_dist(self, live: Sequence[ExecutionView], now: float, r: float) -> Durations:
        ages = [now - x.started_at for x in live if x.started_at is not None]
        return Durations((d for _, _, d in self.started_durations), ages, r)


def seg_s(x: ExecutionView, hist: History, now: float, load: float = 1.0) -> float:
    """Seconds per segment: its own once it has finished one; before, the finished ones' mean times `load`
    (its engine's step time now over the one those were measured at)."""
    if x.turns_done >= 1 and x.started_at is not None:
        return (now - x.started_at) / x.turns_done
    return hist.seg_s * load


def remaining_s(x: ExecutionView, hist: History, now: float, r: float, load: float = 1.0) -> float:
    """Expected seconds until a live execution finishes: expected remaining segments x `seg_s`."""
    return hist.residual_segments(x.turns_done, r) * seg_s(x, hist, now, load)


def drawn_remaining_s(x: ExecutionView, hist: History, dist: Durations, now: float, r: float,
                      load: float = 1.0) -> float | None:
    """Remaining seconds at its quantile level (module docstring); None before anything has finished."""
    u = level(x.id)
    if x.turns_done >= 1 and x.started_at is not None:
        return hist.draw_segments(x.turns_done, u, r) * (now - x.started_at) / x.turns_done
    if not dist:
        return None
    return dist.remaining(now - x.started_at if x.started_at is not None else 0.0, u) * load


def cut_p(x: ExecutionView, hist: History, now: float, r: float, stretch: float = 1.0, load: float = 1.0,
          delay: float = 0.0) -> float:
    """Probability a live execution misses its deadline if it resumes `delay` from now and runs each remaining
    segment `stretch` times as long as so far (Kaplan-Meier survival of its segments)."""
    if x.deadline_at == float("inf"):
        return 0.0
    seg = seg_s(x, hist, now, load)
    if seg <= 0:
        return 0.0
    budget = (x.deadline_at - now - delay) / (seg * stretch)  # segments it can still run
    return 1.0 if budget <= 0 else hist.p_more(x.turns_done, x.turns_done + budget, r)


def boundary_wait_s(x: ExecutionView, hist: History, now: float, rem: float, boundary_share: float, r: float,
                    load: float = 1.0) -> float:
    """Seconds until a live execution can move: 0 unless decoding; `boundary_share` of a segment, or its
    finish `rem` if its segment is expected to be its last (a single-turn rollout moves only by finishing)."""
    if x.phase != Phase.DECODE:
        return 0.0
    if hist.residual_segments(x.turns_done, r) <= 1:
        return rem
    return min(rem, boundary_share * seg_s(x, hist, now, load))


def frees_sooner(executions: Sequence[ExecutionView], finish: Mapping[int, float], waits: Mapping[int, float],
                 now: float) -> bool:
    """Does draining their engine free it before they would empty it by finishing?"""
    if not executions:
        return True
    return max(waits[x.id] for x in executions) < max(finish[x.id] - now for x in executions) - 1e-9


def load_scale(step_s: Callable[[float, float], float], ready: Sequence[EngineView], n_waiting: int, ctx: float,
               seen: float) -> Callable[[int], float]:
    """scale(n): the step time with the live and waiting executions over n engines (within their admission
    limits, `ctx` tokens each) over the step time `seen` the finished ones were measured at."""
    limit = max((e.admit_limit for e in ready), default=1)
    n_work = sum(e.n_live for e in ready) + n_waiting

    def scale(n_engines: int) -> float:
        n = min(n_work, n_engines * limit) / n_engines
        return step_s(n, n * ctx) / seen if seen > 0 and n > 0 else 1.0

    return scale


@dataclass(frozen=True, kw_only=True)
class Forecast:
    """What the controller observes and predicts at one decision point (times absolute)."""

    now: float
    engines: tuple[EngineView, ...]  # the ready engines
    live: tuple[ExecutionView, ...]
    finish: Mapping[int, float]  # execution id -> predicted finish where it is
    waits: Mapping[int, float]  # execution id -> predicted wait for its next tool-call boundary
    pending: tuple[int, ...]  # untrained groups outside the batch in training (ids < 0: still to be admitted)
    due: tuple[int, ...]  # each pending group's batch index by the staleness bound
    finished: frozenset[int]  # pending groups done
    waiting: tuple[int, ...]  # the group id of each execution waiting to start, in order
    durations: tuple[float, ...]  # what finished executions took, in start order (cycled over `waiting`)
    per_batch: int  # groups a batch takes
    free: int  # free GPUs
    per: int  # GPUs an engine takes
    min_train: int  # the trainer's GPU minimum
    starting: tuple[float, ...] = ()  # when each slot of the engines starting is expected to serve
    scale: Callable[[int], float]  # a job's time factor with the work over n engines (load_scale)
    step_s: Callable[[int, float], float]  # an engine's step time at n sequences and KV tokens
    train_s: Callable[[int], float]  # the batch's training seconds on g GPUs
    risk: Callable[..., float]  # risk(x, stretch=1, delay=0): the probability x misses its deadline (cut_p)
    start_s: float  # an engine's start
    stop_s: float  # an engine's stop
    onload_s: float  # the trainer's state onto its GPUs
