"""Pure decisions of the elastic scheduler: which engines to drain, where their executions go.

Everything here is a function of observations (engine load, live executions' current context), never
of the future, and has no side effects, so it is unit-tested on plain stand-ins.

- `choose_victims`: engines to drain so that `need_gpus` GPUs come free, fewest live executions
  first (cheapest to empty; ties: fewest decoding, since a decoding execution moves only at its next
  tool-call boundary; then id). At least one engine always stays.
- `assign_targets`: each migrant (largest context first) to the staying engine with the most free
  KV at that moment (free = capacity * kv_fill - used - already assigned; ties by id).

Simplifications: a decoding execution's KV is counted at its current size (it grows by one segment
before it moves); queued executions hold no KV yet and count as their context (0 if not started).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView


@dataclass(frozen=True)
class DrainPlan:
    victims: tuple[EngineView, ...]
    moves: tuple[tuple[ExecutionView, EngineView], ...]

    @property
    def gpus(self) -> list[int]:
        return [g for e in self.victims for g in e.gpus]


def _drain_order(engines: Sequence[EngineView]) -> list[EngineView]:
    return sorted(engines, key=lambda e: (e.n_live, e.n_decoding, e.id))


def choose_victims(engines: Sequence[EngineView], need_gpus: int) -> list[EngineView]:
    """Engines to drain for `need_gpus` GPUs, fewest live executions first; at least one stays."""
    victims: list[EngineView] = []
    got = 0
    for e in _drain_order(engines):
        if len(victims) >= len(engines) - 1 or got >= need_gpus:
            break
        victims.append(e)
        got += len(e.gpus)
    return victims


def assign_targets(
    executions: Sequence[ExecutionView], targets: Sequence[EngineView], *, kv_fill: float = 0.9
) -> list[tuple[ExecutionView, EngineView]]:
    """Greedy best fit: largest context to the target with the most free KV (deterministic)."""
    if not executions:
        return []
    if not targets:
        raise ValueError("assign_targets: no engine to move executions to")
    heap = [(-(t.kv_capacity * kv_fill - t.kv_used), t.id, i) for i, t in enumerate(targets)]
    heapq.heapify(heap)
    out = []
    for x in sorted(executions, key=lambda x: (-x.context_tokens, x.id)):
        neg_free, tid, i = heapq.heappop(heap)
        out.append((x, targets[i]))
        heapq.heappush(heap, (neg_free + x.context_tokens, tid, i))
    return out


def plan_drain(
    engines: Sequence[EngineView],
    live: Sequence[ExecutionView],
    need_gpus: int,
    *,
    kv_fill: float = 0.9,
) -> DrainPlan:
    """Victims freeing >= need_gpus GPUs (when possible) and a target for each of their executions."""
    victims = choose_victims(engines, need_gpus)
    vids = {e.id for e in victims}
    stay = [e for e in engines if e.id not in vids]
    movers = [x for x in live if x.engine_id in vids]
    return DrainPlan(tuple(victims), tuple(assign_targets(movers, stay, kv_fill=kv_fill)))
