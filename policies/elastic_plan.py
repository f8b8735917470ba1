"""Pure decisions of the elastic scheduler: which engines to drain, where their executions go.

Everything here is a function of observations (engine load, live executions' current context), never
of the future, and has no side effects, so it is unit-tested on plain stand-ins.

- `choose_victims`: engines to drain so that `need_gpus` GPUs come free, fewest live executions
  first (cheapest to empty; ties: fewest decoding, since a decoding execution moves only at its next
  tool-call boundary; then id). At least one engine always stays.
- `assign_targets`: each migrant (largest context first) to the staying engine with the most free
  KV at that moment (free = capacity * kv_fill - used - already assigned; ties by id) among those with
  room left under their admission limit (`slots`, policies.admit_queue); migrants no engine has room for
  are parked instead (`DrainPlan.parks`) and resumed where room frees.
- `next_target`: the trainer's size for the coming steps, judged on the last `size` steps since it last
  moved (never on one step): the largest trainer if the next batch waits, the trainer never waited in
  any of them and its queue of finished groups did not fall; the balanced size if it waited for more
  than half of their time; else unchanged.

Simplifications: a decoding execution's KV is counted at its current size (it grows by one segment
before it moves); queued executions hold no KV yet and count as their context (0 if not started).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView


@dataclass(frozen=True)
class StepRecord:
    """One training step as the trainer saw it."""

    interval: float  # from the previous batch becoming ready to this one
    idle: float  # the trainer, ready for its next batch, waited this long for it
    train: float  # training time
    gpus: int  # GPUs it trained on
    waiting: int = 0  # finished groups waiting for the trainer when the step ended


@dataclass(frozen=True)
class DrainPlan:
    victims: tuple[EngineView, ...]
    moves: tuple[tuple[ExecutionView, EngineView], ...]
    parks: tuple[ExecutionView, ...] = ()  # no staying engine has room: parked until one has

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


def _limit_room(e: EngineView) -> int:
    return e.admit_limit - e.n_live


def assign_targets(
    executions: Sequence[ExecutionView], targets: Sequence[EngineView], *, kv_fill: float = 0.9,
    slots: Callable[[EngineView], int] = _limit_room,
) -> tuple[list[tuple[ExecutionView, EngineView]], list[ExecutionView]]:
    """Greedy best fit: largest context to the target with the most free KV among those with a slot left
    (deterministic). Returns (moves, the executions no target has a slot for)."""
    if not executions:
        return [], []
    if not targets:
        raise ValueError("assign_targets: no engine to move executions to")
    left = {t.id: slots(t) for t in targets}
    heap = [(-(t.kv_capacity * kv_fill - t.kv_used), t.id, i) for i, t in enumerate(targets) if left[t.id] > 0]
    heapq.heapify(heap)
    out, rest = [], []
    for x in sorted(executions, key=lambda x: (-x.context_tokens, x.id)):
        if not heap:
            rest.append(x)
            continue
        neg_free, tid, i = heapq.heappop(heap)
        out.append((x, targets[i]))
        left[tid] -= 1
        if left[tid] > 0:
            heapq.heappush(heap, (neg_free + x.context_tokens, tid, i))
    return out, rest


def plan_drain(
    engines: Sequence[EngineView],
    live: Sequence[ExecutionView],
    need_gpus: int,
    *,
    kv_fill: float = 0.9,
    slots: Callable[[EngineView], int] = _limit_room,
) -> DrainPlan:
    """Victims freeing >= need_gpus GPUs (when possible), a target with room for each of their executions,
    and the executions none has room for (parked)."""
    victims = choose_victims(engines, need_gpus)
    vids = {e.id for e in victims}
    stay = [e for e in engines if e.id not in vids]
    movers = [x for x in live if x.engine_id in vids]
    moves, parks = assign_targets(movers, stay, kv_fill=kv_fill, slots=slots)
    return DrainPlan(tuple(victims), tuple(moves), tuple(parks))


def next_target(
    current: int, window: Sequence[StepRecord], *, backlog: bool, top: int, floor: int, per: int, size: int = 3
) -> int:
    """The trainer target after the steps in `window` (those since the target last moved, oldest first).

    With fewer than `size` steps it holds. Over the last `size`: if the next batch already waits
    (`backlog`), the trainer never waited and the finished groups waiting for it did not fall from the
    first step to the last (a burst of ready batches behind one slow group drains that queue), the
    trainer is the bottleneck: `top`. If the trainer waited for more than half of their time, the
    rollout is: the balanced size, the GPUs that train one batch in the window's mean batch interval
    (sum of GPU-seconds trained / sum of intervals, rounded up to engines of `per`), but at least half
    of `current` (in engines), `floor`, and at most `top`. Otherwise (a burst of ready batches after
    one slow group, one slow batch) it holds. `idle` counts from when the trainer was ready for its next
    batch (engines restarted and synced), so a batch already waiting then is idle 0."""
    w = list(window)[-size:]
    if len(w) < size:
        return current
    if backlog and all(r.idle <= 0 for r in w) and w[-1].waiting >= w[0].waiting:
        return top
    span = sum(r.interval for r in w)
    if span <= 0 or sum(r.idle for r in w) <= span / 2:
        return current
    balanced = -(-int(sum(r.gpus * r.train for r in w) / span) // per) * per
    return max(floor, current // 2 // per * per, min(top, balanced))
