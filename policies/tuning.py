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
returns a local best among the points it tried. `refine_split_and_cap` adds a second axis, a fixed
split's per-engine concurrency cap (its values the `halvings` of the engine's admission limit), by one
batch of every cap at each eta's best split and a local refinement of the split at the cap chosen.

Searches rank only at equal work: a run whose scheduler-induced cuts (sim/harness/sched_cuts.py) exceed the least of
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


def _bisect(axis: str, values: list[int], start: dict[int, list[int]], fixed: dict[int, Params]):
    """At each eta of `start` (eta -> the value indices of a first pass; `fixed`: eta -> the other params
    held there), run the first pass, then the midpoints between the best point so far and its nearest
    tried neighbours until they are adjacent. Returns {eta: index of its best value}."""
    tried: dict[tuple[int, int], float] = {}  # (value index, eta) -> score

    def run(batch: list[tuple[int, int]]):
        batch = [b for b in dict.fromkeys(batch) if b not in tried]
        if not batch:
            return
        scores = yield [{axis: values[i], "eta": e, **fixed.get(e, {})} for i, e in batch]
        tried.update(zip(batch, scores))

    yield from run([(i, e) for e, at in start.items() for i in at])
    while True:
        nxt, best = [], {}
        for eta in start:
            at = sorted(i for i, e in tried if e == eta)
            bi = best[eta] = min(at, key=lambda i: (tried[(i, eta)], -i))
            k = at.index(bi)
            if k > 0 and bi - at[k - 1] > 1:
                nxt.append(((bi + at[k - 1]) // 2, eta))
            if k + 1 < len(at) and at[k + 1] - bi > 1:
                nxt.append(((bi + at[k + 1] + 1) // 2, eta))
        if not nxt:
            return best
        yield from run(nxt)


def refine_axis(axis: str, values: Sequence[int], etas: Sequence[int], *, coarse: int = 5) -> Search:
    """Coarse pass over `values` x `etas`, then bisect towards the best point at each eta."""
    values = sorted(values)
    if values:
        yield from _bisect(axis, values, {e: _spread(len(values), coarse) for e in etas}, {})


def _bracket(points: list[int], i: int) -> list[int]:
    """`i` and its nearest neighbours among `points` (the first pass's indices), one each side."""
    below, above = [p for p in points if p < i], [p for p in points if p > i]
    return [*below[-1:], i, *above[:1]]


def halvings(limit: int) -> list[int]:
    """`limit`, then ceil(limit / 2^k) for k = 1, 2, ... down to 1: the per-engine concurrency caps a
    fixed split searches (each halves the decode batch an engine may carry)."""
    out = [max(1, limit)]
    while out[-1] > 1:
        out.append(-(-limit // 2 ** len(out)))
    return out


def refine_split_and_cap(axis: str, values: Sequence[int], cap_axis: str, caps: Sequence[int],
                         etas: Sequence[int], *, coarse: int = 5) -> Search:
    """`refine_axis` over the split at the largest cap; then, at each eta, every cap at that eta's best
    split in one batch, its best cap kept; then the split refined again at that cap, from the best
    split's neighbours in the first pass. Every cap is tried at once (not one halving at a time while the score
    improves) because equal work is judged against the least-cutting run tried: a halving may cut fewer
    rollouts by less than the tolerance each time and still, a few halvings down, make the uncapped runs
    unequal work. The caps' batch holds the best split's full-limit run again (a comparison reruns nothing
    it has measured), so every cap there is scored against the others and the same least."""
    values, caps = sorted(values), sorted(set(caps), reverse=True)
    if not values or not caps:
        return
    top = {e: {cap_axis: caps[0]} for e in etas}
    first = _spread(len(values), coarse)
    best = yield from _bisect(axis, values, {e: first for e in etas}, top)
    if len(caps) == 1:
        return
    batch = [{axis: values[best[e]], "eta": e, cap_axis: c} for e in etas for c in caps]
    scores = yield batch
    cap: dict[int, int] = {}  # eta -> its best-scoring cap (a tie to the larger)
    for _, p in sorted(zip(scores, batch), key=lambda x: (x[0], -x[1][cap_axis])):
        cap.setdefault(p["eta"], p[cap_axis])
    at = {e: _bracket(first, best[e]) for e in etas if cap[e] != caps[0]}
    if at:
        yield from _bisect(axis, values, at, {e: {cap_axis: cap[e]} for e in at})


def drive(search: Search, evaluate, executions: int | None = None) -> list[tuple[Params, float]]:
    """Run a search to its end; `evaluate(batch) -> makespans`, or, given the run's `executions`,
    `-> [(makespan, sched_cuts)]`, ranked at equal work. Returns every (params, makespan) tried, once."""
    out: dict[tuple, tuple[Params, float]] = {}
    work = EqualWork(executions) if executions is not None else None
    try:
        batch = next(search)
        while True:
            measured = list(evaluate(batch))
            makespans = [m[0] for m in measured] if work else measured
            out.update({tuple(sorted(p.items())): (p, m) for p, m in zip(batch, makespans)})
            batch = search.send(work.scores(makespans, [m[1] for m in measured]) if work else makespans)
    except StopIteration:
        pass
    return list(out.values())
