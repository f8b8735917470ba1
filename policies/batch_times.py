"""When the Batcher's coming batches are ready and trained, given when each untrained group ends.

A model of policies.common.Batcher for forecasts (policies.elastic): batch j takes every group due by step j
(the staleness bound), then the earliest-finishing others, and is ready when the last it takes ends.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


def batch_ready_times(group_ends: Sequence[float], per_batch: int, due: Sequence[int] | None = None) -> list[float]:
    """When each coming batch is ready: batch j takes every group due by j, then the earliest-finishing others
    up to `per_batch`, and is ready when the last it takes ends (without `due`: in order of finish)."""
    left = sorted(zip(group_ends, due if due is not None else [len(group_ends)] * len(group_ends)))
    out: list[float] = []
    j = 0
    while left:
        need = [i for i, (_, d) in enumerate(left) if d <= j]
        take = set(need[:per_batch]) if len(need) >= per_batch else set(need)
        for i in range(len(left)):
            if len(take) >= per_batch:
                break
            take.add(i)
        out.append(max(left[i][0] for i in take))
        left = [g for i, g in enumerate(left) if i not in take]
        j += 1
    return out


def last_batch_end(start: float, group_ends: Sequence[float], per_batch: int, train_s: float,
                   due: Sequence[int] | None = None, batches: int | None = None) -> float:
    """When the last of these groups (or of the first `batches` batches) is trained, the trainer free from
    `start`: the objective of every decision."""
    t = start
    for r in batch_ready_times(group_ends, per_batch, due)[:batches]:
        t = max(t, r) + train_s
    return t


def run_queue(free_at: Sequence[float], durations: Sequence[float],
              factor: Callable[[int, float], float] = lambda i, t: 1.0) -> list[float]:
    """Each job's finish: it takes the earliest free slot and frees it when done; job i started at t takes its
    duration times factor(i, t)."""
    heap = list(free_at)
    heapq.heapify(heap)
    out = []
    for i, d in enumerate(durations):
        t = heapq.heappop(heap) if heap else float("inf")
        out.append(t + d * factor(i, t))
        heapq.heappush(heap, out[-1])
    return out
