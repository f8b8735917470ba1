"""A per-engine concurrency that keeps live executions' deadlines: the most executions an engine may carry so
that each of its live executions, slowed by the engine's larger step, is still predicted to finish in time.
A decoding execution gains one token per engine step, so at n sequences its remaining time scales by
step_s(n) / step_s(its engine's n now). One that would miss its deadline even alone is past help and sets no
cap. policies.elastic hands each engine at most this (docs/elastic.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView


def deadline_cap(remaining: Sequence[tuple[float, float]], now: float, step_s: Callable[[int], float],
                 n_now: int, limit: int) -> int:
    """The largest n in [1, limit] at which every (remaining seconds at `n_now` sequences, deadline) in
    `remaining` still meets its deadline (limit if none is at risk); step_s is non-decreasing: bisection."""
    base = step_s(max(n_now, 1))
    if base <= 0:
        return limit
    alone = step_s(1) / base
    slack = [(deadline - now) / rem for rem, deadline in remaining
             if rem > 0 and deadline < float("inf") and now + rem * alone <= deadline]
    if not slack:
        return limit
    most = min(slack) * base  # the longest step every one of them can afford
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid) <= most:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DeadlineCaps:
    """`deadline_cap` per engine, from `remaining()` (a function of an execution and its engine's load factor
    from `loads()`: its predicted remaining seconds) and the cluster estimate's step time; computed once per
    engine per instant. An engine with no live execution under a deadline keeps its admission limit."""

    def __init__(self, cluster: Cluster, remaining: Callable[[], Callable[[ExecutionView, float], float]],
                 loads: Callable[[], dict[int, float]]) -> None:
        self.cluster, self.remaining, self.loads = cluster, remaining, loads
        self.at, self.caps, self.by_engine, self.rem = -1.0, {}, {}, None

    def __call__(self, e: EngineView) -> int:
        now = self.cluster.now
        if self.at != now:
            self.at, self.caps, self.by_engine, self.rem = now, {}, {}, None
            for x in self.cluster.live():
                if x.deadline_at < float("inf"):
                    self.by_engine.setdefault(x.engine_id, []).append(x)
        if e.id not in self.caps:
            mine = self.by_engine.get(e.id)
            if not mine:
                self.caps[e.id] = e.admit_limit
            else:
                self.rem = self.rem or self.remaining()
                f = self.loads().get(e.id, 1.0)
                per, est = e.kv_used / max(e.n_live, 1), self.cluster.estimate
                self.caps[e.id] = deadline_cap([(self.rem(x, f), x.deadline_at) for x in mine], now,
                                               lambda n: est.step_s(n, n * per), e.n_live, e.admit_limit)
        return self.caps[e.id]
