"""How a comparison tunes a policy: a search over its parameter sets, driven by measured makespans.

A search is a generator: it yields a batch of parameter sets (dicts), is sent back their makespans (a
list in the same order) and yields the next batch, until it returns. The comparison runs each batch in
parallel. A policy declares one with `search(shape, etas)`; one with only `grid(shape, etas)` is
searched exhaustively (`exhaustive`), and one with neither runs once as configured.

`refine_axis` is the search for a policy with one integer axis (async's rollout GPUs) times a small set
of etas: a coarse pass over up to `coarse` evenly spaced axis points at every eta, then, at every eta,
the midpoints between its best point so far and that point's nearest tried neighbours, until those
neighbours are adjacent grid points. If the makespan is unimodal in the axis at each eta it finds the
grid's best in about etas x (coarse + 2 log2(points / coarse)) runs instead of points x etas;
`tests/test_tuning.py` checks it against the exhaustive grid. Where a curve has several dips it
returns a local best among the points it tried.

Searches rank only at equal work: a run whose scheduler-induced cuts (policies.work) exceed the least of
the runs tried by more than WORK_TOLERANCE of the run's executions did less of the work, so it is never
the best. `EqualWork` turns measured (makespan, cuts) into what a search is sent (such a run's makespan
becomes inf); `fastest_at_equal_work` picks the best of a finished search the same way.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

Params = dict[str, Any]
Search = Generator[list[Params], list[float], None]

WORK_TOLERANCE = 0.01  # share of the run's executions by which a run may cut more than the least-cutting one


def equal_work(cuts: Sequence[int], executions: int) -> list[bool]:
    """Which runs do equal work: their scheduler-induced cuts exceed the least of `cuts` by at most
    WORK_TOLERANCE x executions."""
    least = min(cuts, default=0)
    return [c - least <= WORK_TOLERANCE * executions for c in cuts]


def fastest_at_equal_work(makespans: Sequence[float], cuts: Sequence[int], executions: int,
                          tie: Sequence[float] | None = None) -> int:
    """Index of the fastest run among those doing equal work; a tie goes to the least `tie`."""
    ok = equal_work(cuts, executions)
    return min((i for i in range(len(makespans)) if ok[i]), key=lambda i: (makespans[i], tie[i] if tie else 0))


class EqualWork:
    """What one search is sent: each run's makespan, or inf once its cuts exceed the least of every run
    this search has measured (this batch included) by more than WORK_TOLERANCE x executions."""

    def __init__(self, executions: int) -> None:
        self.executions = executions
        self.least = math.inf

    def scores(self, makespans: Sequence[float], cuts: Sequence[int]) -> list[float]:
        self.least = min(self.least, *cuts) if cuts else self.least
        limit = self.least + WORK_TOLERANCE * self.executions
        return [m if c <= limit else math.inf for m, c in zip(makespans, cuts)]


def exhaustive(grid: Sequence[Params]) -> Search:
    """Every parameter set in one batch."""
    if grid:
        yield list(grid)


def _spread(n: int, k: int) -> list[int]:
    """Up to k indices evenly spaced over range(n), both ends included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def refine_axis(axis: str, values: Sequence[int], etas: Sequence[int], *, coarse: int = 5) -> Search:
    """Coarse pass over `values` x `etas`, then bisect towards the best point at the best eta."""
    values = sorted(values)
    if not values:
        return
    tried: dict[tuple[int, int], float] = {}  # (value index, eta) -> makespan

    def run(batch: list[tuple[int, int]]):
        batch = [b for b in dict.fromkeys(batch) if b not in tried]
        if not batch:
            return
        makespans = yield [{axis: values[i], "eta": e} for i, e in batch]
        tried.update(zip(batch, makespans))

    yield from run([(i, e) for e in etas for i in _spread(len(values), coarse)])
    while True:
        nxt = []
        for eta in etas:
            at = sorted(i for i, e in tried if e == eta)
            bi = min(at, key=lambda i: (tried[(i, eta)], -i))
            k = at.index(bi)
            if k > 0 and bi - at[k - 1] > 1:
                nxt.append(((bi + at[k - 1]) // 2, eta))
            if k + 1 < len(at) and at[k + 1] - bi > 1:
                nxt.append(((bi + at[k + 1] + 1) // 2, eta))
        if not nxt:
            return
        yield from run(nxt)


def drive(search: Search, evaluate, executions: int | None = None) -> list[tuple[Params, float]]:
    """Run a search to its end; `evaluate(batch) -> makespans`, or, given the run's `executions`,
    `-> [(makespan, sched_cuts)]`, ranked at equal work. Returns every (params, makespan) tried."""
    out: list[tuple[Params, float]] = []
    work = EqualWork(executions) if executions is not None else None
    try:
        batch = next(search)
        while True:
            measured = list(evaluate(batch))
            makespans = [m[0] for m in measured] if work else measured
            out += zip(batch, makespans)
            batch = search.send(work.scores(makespans, [m[1] for m in measured]) if work else makespans)
    except StopIteration:
        pass
    return out
