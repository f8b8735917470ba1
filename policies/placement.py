"""Where migrating executions go (pure functions of engines' load and KV): best fit by free KV for a drain's
migrants (`assign_targets`), and evening the live executions out over engines (`spread_moves`). A target's KV
stays below `kv_fill` of its capacity and it takes no more than `slots(e)` (default: its admission limit's room).
Used by policies.elastic (docs/elastic.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from gyre.cluster import EngineView, ExecutionView


def room(e: EngineView) -> int:
    return e.admit_limit - e.n_live


def assign_targets(executions: Sequence[ExecutionView], targets: Sequence[EngineView], *, kv_fill: float,
                   slots: Callable[[EngineView], int] = room
                   ) -> tuple[list[tuple[ExecutionView, EngineView]], list[ExecutionView]]:
    """Best fit, largest context first, to the target with the most free KV below `kv_fill` and room (`slots`);
    ties by id. Returns (moves, the executions no target can take)."""
    free = {t.id: t.kv_capacity * kv_fill - t.kv_used for t in targets}
    left = {t.id: slots(t) for t in targets}
    heap = [(-free[t.id], t.id, i) for i, t in enumerate(targets) if left[t.id] > 0]
    heapq.heapify(heap)
    moves, parks = [], []
    for x in sorted(executions, key=lambda x: (-x.context_tokens, x.id)):
        if heap and -heap[0][0] >= x.context_tokens:
            neg, tid, i = heapq.heappop(heap)
            moves.append((x, targets[i]))
            left[tid] -= 1
            if left[tid] > 0:
                heapq.heappush(heap, (neg + x.context_tokens, tid, i))
        else:  # the roomiest target cannot take the largest remaining context: neither can any other
            parks.append(x)
    return moves, parks


def spread_moves(engines: Sequence[EngineView], live: Sequence[ExecutionView], *, kv_fill: float,
                 slots: Callable[[EngineView], int] = room) -> list[tuple[ExecutionView, EngineView]]:
    """Even the live executions out: an engine above ceil(mean) gives its smallest contexts to the one carrying
    fewest while that narrows the gap, it has room (`slots`) and KV below `kv_fill`; ties by id."""
    if not engines:
        return []
    high = -(-sum(e.n_live for e in engines) // len(engines))
    load = {e.id: e.n_live for e in engines}
    left = {e.id: slots(e) for e in engines}
    kv = {e.id: kv_fill * e.kv_capacity - e.kv_used for e in engines}
    mine: dict[int, list[ExecutionView]] = {}
    for x in live:
        mine.setdefault(x.engine_id, []).append(x)
    moves = []
    for src in sorted(engines, key=lambda e: (-e.n_live, e.id)):
        for x in sorted(mine.get(src.id, []), key=lambda x: (x.context_tokens, x.id)):
            if load[src.id] <= high:
                break
            dst = min((e for e in engines if e.id != src.id and left[e.id] > 0 and kv[e.id] >= x.context_tokens),
                      key=lambda e: (load[e.id], e.id), default=None)
            if dst is None or load[dst.id] + 2 > load[src.id]:
                break
            moves.append((x, dst))
            load[src.id] -= 1
            load[dst.id] += 1
            left[dst.id] -= 1
            kv[dst.id] -= x.context_tokens
    return moves
