"""Placement by age: an execution that has outlived most rollouts runs on an engine with few sequences.

An engine step with n sequences takes step(n) for each of them (gyre.estimate's step_s: on the hybrid
2.4T at 300K context 10.4 ms at n = 1, 12.2 ms at 5, 16.6 ms at 16, 29.4 ms at 63), so a sequence's
deadline is met at a high concurrency only if it is short. On xlong-swe-kv (deadline 4 h) most executions
finish their tokens at 16 or more per engine; only the long tail needs 4-5, for its whole life. One cap for
every execution (`max_running`) charges every execution the tail's concurrency. The length is not known
in advance; its age is observed, and age alone is what a heavy tail makes predictive (an execution that has
run t seconds expects about t more: policies.elastic_history's Kaplan-Meier residual). So concurrency falls
with age in tiers (`ElasticConfig.tiers`: from each age on, the most sequences an engine holding such an
execution may run):

- an engine is handed no more executions than the tier of the oldest execution it holds (`TierCaps`);
- an execution whose engine holds more than its tier allows moves at its next tool-call boundary (the
  cluster's migrate verb, never an abort) to an engine that has room under both its own tier and that of
  every execution there, with KV below `kv_fill` (`sort_moves`); engines already holding old executions
  are preferred, the fullest first, so the old ones gather on few engines and the rest keep the high tier.

Functions of observations only (ages, engine loads, contexts). Simplifications: the tiers are fixed for
the run (a choice like `max_running`, which `Elastic.grid` does not search yet: run48.py --tiers); a move
re-prefills the context on its target, which this rule does not price.

Measured (experiments/elastic_vs_baselines/README.md, first section): on xlong-swe-kv over 48 steps the tiers
sit on the uniform cap's makespan-vs-cuts frontier (a finer knob than an integer cap, not a better one), and
no rule on an execution's progress alone can save more than ~10% of the decode GPU-time at equal cuts
(placement_bound.py); only length foresight would.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView, Phase


def tier_of(age_s: float, tiers: Sequence[tuple[float, int]]) -> int:
    """The most sequences an engine holding an execution of this age may run: the n of the last tier whose
    age the execution has reached (tiers ascend in age, descend in n; the first starts at age 0)."""
    n = tiers[0][1]
    for at, m in tiers:
        if age_s >= at:
            n = m
    return n


def age_s(x: ExecutionView, now: float) -> float:
    """Seconds since the execution first ran (0 before: its deadline clock has not started)."""
    return 0.0 if x.started_at is None else now - x.started_at


def engine_tiers(live: Sequence[ExecutionView], now: float, tiers: Sequence[tuple[float, int]]) -> dict[int, int]:
    """Each engine's tier: the least tier of the live executions on it (engines without any: absent)."""
    out: dict[int, int] = {}
    for x in live:
        if x.engine_id is not None and x.phase != Phase.PARKED:
            t = tier_of(age_s(x, now), tiers)
            out[x.engine_id] = min(out.get(x.engine_id, t), t)
    return out


def sort_moves(engines: Sequence[EngineView], live: Sequence[ExecutionView], now: float,
               tiers: Sequence[tuple[float, int]], *, kv_fill: float, incoming: dict[int, int],
               moving: set[int] = frozenset()) -> list[tuple[ExecutionView, EngineView]]:
    """The moves that place over-tier executions (on an engine holding more than their tier allows, moves in
    flight counted) on engines with room under their tier and every resident's, KV within `kv_fill`: the
    oldest first; targets with the least tier first (they already hold old executions), then the fullest,
    then the lowest id. Executions in `moving` (a move already asked) stay; one with no such target stays."""
    by_id = {e.id: e for e in engines}
    tier = engine_tiers(live, now, tiers)
    load = {e.id: e.n_live + incoming.get(e.id, 0) for e in engines}
    kv = {e.id: e.kv_used for e in engines}
    moves = []
    over = [x for x in live if x.engine_id in by_id and x.id not in moving and x.phase != Phase.PARKED
            and load[x.engine_id] > tier_of(age_s(x, now), tiers)]
    for x in sorted(over, key=lambda x: (-age_s(x, now), x.id)):
        mine = tier_of(age_s(x, now), tiers)
        if load[x.engine_id] <= mine:  # an earlier move made room here
            continue
        fits = [e for e in engines if e.id != x.engine_id
                and load[e.id] + 1 <= min(mine, tier.get(e.id, mine), e.admit_limit)
                and kv[e.id] + x.context_tokens <= kv_fill * e.kv_capacity]
        if not fits:
            continue
        t = min(fits, key=lambda e: (tier.get(e.id, tiers[0][1]), -load[e.id], e.id))
        moves.append((x, t))
        load[t.id] += 1
        load[x.engine_id] -= 1
        kv[t.id] += x.context_tokens
        tier[t.id] = min(tier.get(t.id, mine), mine)
    return moves


class TierCaps:
    """The pool's per-engine cap from the tiers: the least tier of its live executions (its admission limit if
    it holds none), computed once per instant."""

    def __init__(self, cluster: Cluster, tiers: Sequence[tuple[float, int]]) -> None:
        self.cluster, self.tiers = cluster, tiers
        self.at, self.caps = -1.0, {}

    def __call__(self, e: EngineView) -> int:
        now = self.cluster.now
        if self.at != now:
            self.at, self.caps = now, engine_tiers(self.cluster.live(), now, self.tiers)
        return self.caps.get(e.id, self.tiers[0][1])
