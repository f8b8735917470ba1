"""Pieces every policy uses: engine layout, load balancing, a wake-up signal, and the batcher that
enforces the staleness bound.

Staleness rule (Batcher): a group is admitted at version a (the oldest weights any of its engines
serve). Admission is allowed while admitted < (version + eta + 1) * groups_per_step. The batch for
step v contains every unfinished-or-finished group with a <= v - eta ("due": it would be too stale
one step later; the trainer waits for them), then finished groups with the lowest (a, finish order)
up to groups_per_step. So every trained sample has staleness v - a <= eta, and every admitted group
is trained exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre.cluster import Cluster, EngineView, Group
from gyre.handles import Handle


def engine_slots(gpus: Sequence[int], per_engine: int) -> list[tuple[int, ...]]:
    """Split GPUs into engine-sized slots (leftovers that cannot hold an engine are dropped)."""
    gpus = list(gpus)
    return [tuple(gpus[i : i + per_engine]) for i in range(0, len(gpus) - per_engine + 1, per_engine)]


def least_loaded(engines: Sequence[EngineView]) -> EngineView:
    """The ready engine holding the fewest executions per KV token of capacity; ties by id."""
    return min((e for e in engines if e.ready), key=lambda e: (e.n_live / max(e.kv_capacity, 1), e.id))


def spread(cluster: Cluster, executions: Sequence, engines: Sequence[EngineView]) -> list[Handle]:
    """Admit executions one by one, each to the then least-loaded ready engine (as `least_loaded`
    would choose), in O(log engines) per admission. Returns their completion handles."""
    import heapq

    heap = [(e.n_live / max(e.kv_capacity, 1), e.id, i) for i, e in enumerate(engines) if e.ready]
    heapq.heapify(heap)
    handles = []
    for x in executions:
        load, eid, i = heap[0]
        e = engines[i]
        handles.append(cluster.admit(x, e))
        heapq.heapreplace(heap, (e.n_live / max(e.kv_capacity, 1), eid, i))
    return handles


class Signal:
    """A reusable wake-up: `wait()` returns a handle completed by the next `fire()`."""

    def __init__(self) -> None:
        self._h = Handle("signal")

    def wait(self) -> Handle:
        return self._h

    def fire(self) -> None:
        h, self._h = self._h, Handle("signal")
        h.succeed(None)


class Batcher:
    """Tracks groups from admission to training under the staleness bound eta."""

    def __init__(self, cluster: Cluster, steps: int, eta: int) -> None:
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.cluster = cluster
        self.steps = steps
        self.eta = eta
        self.gps = cluster.groups_per_step
        self.admitted: list[tuple[int, Group]] = []  # (admit version, group), untrained
        self.finished: list[int] = []  # group ids in finish order
        self.n_admitted = 0
        self.n_trained = 0
        self.changed = Signal()

    def can_admit(self) -> bool:
        v = self.cluster.version
        return self.n_admitted < min((v + self.eta + 1) * self.gps, self.steps * self.gps)

    def admit_group(self, version: int) -> Group:
        """Take the next group; the caller admits its executions and calls `watch`."""
        g = self.cluster.next_group()
        self.admitted.append((version, g))
        self.n_admitted += 1
        return g

    def watch(self, group: Group, handles: Sequence[Handle]) -> None:
        from gyre.handles import all_of

        def done(_h: Handle) -> None:
            self.finished.append(group.id)
            self.changed.fire()

        all_of(handles).on_done(done)

    def next_batch(self) -> list[Group] | None:
        """The batch for step `version`, or None if the trainer must wait."""
        v = self.cluster.version
        rank = {gid: i for i, gid in enumerate(self.finished)}
        due = [(a, g) for a, g in self.admitted if a <= v - self.eta]
        if any(g.id not in rank for _, g in due):
            return None
        ready = sorted(((a, rank[g.id], g) for a, g in self.admitted if g.id in rank), key=lambda x: x[:2])
        last = v == self.steps - 1
        want = len(self.admitted) if last else self.gps
        if last and self.n_admitted < self.steps * self.gps:
            return None
        if len(ready) < want:
            return None
        batch = [g for _, g in due]
        ids = {g.id for g in batch}
        for _, _, g in ready:
            if len(batch) >= want:
                break
            if g.id not in ids:
                batch.append(g)
                ids.add(g.id)
        return batch

    def trained(self, batch: Sequence[Group]) -> None:
        ids = {g.id for g in batch}
        self.admitted = [(a, g) for a, g in self.admitted if g.id not in ids]
        self.finished = [gid for gid in self.finished if gid not in ids]
        self.n_trained += len(batch)
