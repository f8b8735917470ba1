"""Predictions of single live executions for the elastic controller: when each finishes, how likely it is cut,
how long it takes to reach a tool-call boundary, and how an engine's load stretches it.

Functions of observations only (the execution's progress, what finished executions showed: `History`,
policies.elastic_history; an engine's load through the cost estimate's step time), never of the future,
with no side effects. policies.elastic_plan builds the controller's plans on them; the rule is stated
once, in policies/elastic.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.cluster import EngineView, ExecutionView, Phase
from gyre.policies.elastic_history import History

def cut_p(x: ExecutionView, hist: History, now: float, unseen_residual: float, stretch: float = 1.0,
          load: float = 1.0, delay: float = 0.0) -> float:
    """Probability that a live execution is cut by its deadline if it resumes its remaining segments `delay`
    from now and runs each `stretch` times as long as it has so far: P(segments > done + the segments its
    budget leaves | segments > done) from the Kaplan-Meier survival; past the largest observation the tail
    falls as a Pareto of index 1 + 1 / unseen_residual (whose mean residual life is unseen_residual x age)."""
    if x.deadline_at == float("inf"):
        return 0.0
    done = x.turns_done
    seg = seg_s(x, hist, now, load)
    if seg <= 0:
        return 0.0
    budget = (x.deadline_at - now - delay) / (seg * stretch)  # segments it can still run
    if budget <= 0:
        return 1.0
    return hist.p_more(done, done + budget, unseen_residual)


def seg_s(x: ExecutionView, hist: History, now: float, load: float = 1.0) -> float:
    """A live execution's seconds per segment: its own so far once it has finished one; before that the
    finished executions' mean, times `load`: its engine's step time now over the step time those were
    measured at (a decoding sequence gains one token per engine step, so its segment lasts as many steps
    whatever the load; single-turn rollouts have no rate of their own until they finish)."""
    if x.turns_done >= 1 and x.started_at is not None:
        return (now - x.started_at) / x.turns_done
    return hist.seg_s * load


def remaining_s(x: ExecutionView, hist: History, now: float, unseen_residual: float, load: float = 1.0) -> float:
    """Expected seconds until a live execution finishes (module docstring; `load` as in `seg_s`)."""
    return hist.residual_segments(x.turns_done, unseen_residual) * seg_s(x, hist, now, load)


def protected_remaining_s(x: ExecutionView, hist: History, now: float, unseen_residual: float, level: float,
                          load: float = 1.0) -> float:
    """Seconds until a live execution finishes if it runs the remaining segments its conditional
    distribution exceeds with probability 1 - `level` (History.draw_segments), at its seconds per segment
    (`seg_s`): the remaining time an admission protects when it protects all but that share of the tail."""
    return hist.draw_segments(x.turns_done, level, unseen_residual) * seg_s(x, hist, now, load)


def load_scale(step_s: Callable[[float, float], float], ready: Sequence[EngineView], n_queued: int, ctx: float,
               seen: float) -> Callable[[int], float]:
    """scale(n): the estimate's engine step time with the live and queued executions spread over n engines
    (at most each one's admission limit; `ctx` tokens each), over the step time `seen` the finished
    executions were measured at (1 before any was)."""
    limit = max((e.admit_limit for e in ready), default=1)
    n_work = sum(e.n_live for e in ready) + n_queued

    def scale(n_engines: int) -> float:
        n = min(n_work, n_engines * limit) / n_engines
        return step_s(n, n * ctx) / seen if seen > 0 and n > 0 else 1.0

    return scale


def live_ends(live: Sequence[ExecutionView], finish: dict[int, float], now: float) -> dict[int, float]:
    """Each group's latest predicted finish (`finish`, absolute) over its live executions."""
    ends: dict[int, float] = {}
    for x in live:
        ends[x.group_id] = max(ends.get(x.group_id, now), finish[x.id])
    return ends


def boundary_wait_s(x: ExecutionView, hist: History, now: float, rem: float, boundary_share: float,
                    unseen_residual: float, load: float = 1.0) -> float:
    """Expected seconds until a live execution can move: 0 unless it decodes; a decoding one at its next
    tool-call boundary, `boundary_share` of a segment away, or at its finish if its current segment is
    expected to be its last (it reaches no boundary: a single-turn rollout moves only by finishing)."""
    if x.phase != Phase.DECODE:
        return 0.0
    done = x.turns_done
    if hist.residual_segments(done, unseen_residual) <= 1:
        return rem
    return min(rem, boundary_share * seg_s(x, hist, now, load))


def frees_sooner(executions: Sequence[ExecutionView], finish: dict[int, float], waits_s: dict[int, float],
                 now: float) -> bool:
    """Does draining the engine holding these executions free it before they would empty it by finishing?
    Its GPUs are free once the slowest reaches its tool-call boundary (`waits_s`); a single-turn rollout
    reaches none (its wait is its finish), so an engine of them empties no sooner drained than left alone,
    and the drain would only hold up the next decision (one drain at a time)."""
    if not executions:
        return True
    return max(waits_s[x.id] for x in executions) < max(finish[x.id] - now for x in executions) - 1e-9
