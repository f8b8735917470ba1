"""The elastic controller's predictions of one live execution from what it has observed (policies.lengths), and
`Forecast`, the snapshot every decision reads. Nothing here sees a future length (docs/elastic.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView, Phase
from gyre.policies.lengths import Durations, History, level


def seg_s(x: ExecutionView, hist: History, now: float, load: float = 1.0) -> float:
    """Its own seconds per segment, or before it has one the finished ones' times `load` (its engine's step now
    over the one those were measured at)."""
    if x.turns_done >= 1 and x.started_at is not None:
        return (now - x.started_at) / x.turns_done
    return hist.seg_s * load


def remaining_s(x: ExecutionView, hist: History, now: float, r: float, load: float = 1.0) -> float:
    """Expected seconds until a live execution finishes: expected remaining segments x `seg_s`."""
    return hist.residual_segments(x.turns_done, r) * seg_s(x, hist, now, load)


def drawn_remaining_s(x: ExecutionView, hist: History, dist: Durations, now: float, r: float,
                      load: float = 1.0) -> float | None:
    """Remaining seconds at its quantile level: drawn segments at its own pace once it has finished one, else
    its duration given its age times `load`; None before anything has finished."""
    u = level(x.id)
    if x.turns_done >= 1 and x.started_at is not None:
        return hist.draw_segments(x.turns_done, u, r) * (now - x.started_at) / x.turns_done
    if not dist:
        return None
    return dist.remaining(now - x.started_at if x.started_at is not None else 0.0, u) * load


def cut_p(x: ExecutionView, hist: History, now: float, r: float, stretch: float = 1.0, load: float = 1.0,
          delay: float = 0.0) -> float:
    """P(it misses its deadline) if it resumes `delay` from now and each segment takes `stretch` times as long."""
    if x.deadline_at == float("inf"):
        return 0.0
    seg = seg_s(x, hist, now, load)
    if seg <= 0:
        return 0.0
    budget = (x.deadline_at - now - delay) / (seg * stretch)  # segments it can still run
    return 1.0 if budget <= 0 else hist.p_more(x.turns_done, x.turns_done + budget, r)


def boundary_wait_s(x: ExecutionView, hist: History, now: float, rem: float, boundary_share: float, r: float,
                    load: float = 1.0) -> float:
    """Seconds until it can move: 0 unless decoding; else `boundary_share` of a segment, or its finish `rem` if
    this segment is expected to be its last."""
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
    """scale(n): the step time with the live and waiting executions over n engines over the one `seen`."""
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
