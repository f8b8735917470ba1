"""Pieces every policy uses: engine layout, load balancing, admission by room (`spread`, over
policies.admit_queue), a wake-up signal, the batcher that enforces the staleness bound, and the
producer/train loop async and elastic share (`train_loop`).

Staleness rule (Batcher): a group admitted at version a (the oldest weights its engines serve) must be
trained by step a + eta, its deadline; step v trains exactly groups_per_step groups. This is unit-capacity
deadline scheduling, and the Batcher keeps it feasible at all times:
- admission: a group may join only if, for every deadline T >= its own, the untrained groups due by T
  fit into the steps left until T: |{untrained: deadline <= T}| <= (T - s + 1) * groups_per_step, where
  s is the next step to batch (a batch already taken but still training has no room left);
- batching: step v takes every group due at v (the trainer waits for them), then finished groups in
  (deadline, finish order), and only if the groups left over stay feasible for the steps after v;
  otherwise it waits for more groups to finish.
So every trained sample has staleness <= eta, every admitted group is trained exactly once, and no
batch is larger than groups_per_step. A group's executions may wait unstarted for room on an engine
(policies.admit_queue) after the Batcher admits it at version a: each then first runs at a version >= a
(engines only move forward), so the version of its oldest token is >= a and its staleness when trained
by step a + eta is still <= eta; the trainer waits for a due group, and a waiting execution is admitted
as soon as any admitted one finishes (FIFO), so it waits only on executions that end.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from gyre.cluster import Cluster, ClusterError, EngineView, Group
from gyre.handles import Handle, all_of, any_of
from gyre.policies.admit_queue import AdmissionQueue


@dataclass(frozen=True, kw_only=True)
class ClusterShape:
    """What a policy's sweep grid may depend on: the pool and the model's GPU needs."""

    n_gpus: int
    gpus_per_engine: int
    min_train_gpus: int
    admit_limit: int | None = None  # executions an engine is handed at once (gyre.hardware.admission_limit); None: unknown


def engine_slots(gpus: Sequence[int], per_engine: int) -> list[tuple[int, ...]]:
    """Split GPUs into engine-sized slots (leftovers that cannot hold an engine are dropped)."""
    gpus = list(gpus)
    return [tuple(gpus[i : i + per_engine]) for i in range(0, len(gpus) - per_engine + 1, per_engine)]


def least_loaded(engines: Sequence[EngineView]) -> EngineView:
    """The ready engine holding the fewest executions per KV token of capacity; ties by id."""
    return min((e for e in engines if e.ready), key=lambda e: (e.n_live / max(e.kv_capacity, 1), e.id))


def spread(cluster: Cluster, executions: Sequence, engines: Sequence[EngineView]) -> list[Handle]:
    """Admit executions to these engines as they have room (policies.admit_queue): each goes to the then
    least-loaded engine with room, the rest wait unstarted and start as admitted ones finish. Returns their
    finish handles. The queue is this call's own: a policy that admits onto the same engines again and
    again keeps one `AdmissionQueue` instead, so that every finish lets the oldest waiting one in."""
    return AdmissionQueue(cluster, engines).submit(executions)


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

    def __init__(self, cluster: Cluster, steps: int, eta: int,
                 on_finish: Callable[[Group, Handle], None] | None = None) -> None:
        """Groups are admitted in the cluster's drawn order. `on_finish(group, handle)`, if given, is called
        as each admitted execution finishes (after the Batcher has counted its group finished, if it was the
        group's last)."""
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        mu = getattr(cluster, "steps_per_burst", 1)
        if eta < mu - 1:  # engines serve every mu-th version: a group admitted at a burst's start waits mu - 1 steps
            raise ClusterError(f"eta={eta} is below steps_per_burst - 1 = {mu - 1}: engines serve a new version "
                               f"only every {mu} steps")
        self.cluster = cluster
        self.on_finish = on_finish
        self.steps = steps
        self.eta = eta
        self.gps = cluster.groups_per_step
        self.admitted: list[tuple[int, Group]] = []  # (admit version, group), untrained
        self.finished: list[int] = []  # group ids in finish order
        self.n_admitted = 0
        self.n_trained = 0
        self.step = 0  # the step the next batch trains (batches are taken in step order)
        self.open: list[Group] = []  # a streaming step's batch so far (step `self.step`), filled by `take_ready`
        self.changed = Signal()

    def _feasible(self, deadlines: list[int], first_step: int, used: int = 0) -> bool:
        """Can groups with these deadlines all be trained in steps first_step, first_step + 1, ..., when `used`
        of first_step's places are taken already?"""
        for i, d in enumerate(sorted(deadlines)):  # the i+1 earliest must fit by step d
            if i + 1 > (d - first_step + 1) * self.gps - used:
                return False
        return True

    def can_admit(self, version: int | None = None) -> bool:
        """May a group admitted now at `version` (default: the trainer's) join without breaking the bound?"""
        v = self.step
        a = self.cluster.version if version is None else version
        if self.n_admitted >= self.steps * self.gps or a + self.eta < v:
            return False
        return self._feasible([x + self.eta for x, _ in self.admitted] + [a + self.eta], v, len(self.open))

    def admit_group(self, version: int) -> Group:
        """Take the next group; the caller admits its executions and calls `watch`."""
        g = self.cluster.next_group()
        self.admitted.append((version, g))
        self.n_admitted += 1
        return g

    def watch(self, group: Group, handles: Sequence[Handle]) -> None:
        def done(_h: Handle) -> None:
            self.finished.append(group.id)
            self.changed.fire()

        all_of(handles).on_done(done)
        if self.on_finish is not None:
            for h in handles:
                h.on_done(lambda h, group=group: self.on_finish(group, h))

    def next_batch(self) -> list[Group] | None:
        """The batch for the next step (`self.step`), or None if the trainer must wait."""
        v = self.step
        if v >= self.steps:
            return None
        rank = {gid: i for i, gid in enumerate(self.finished)}
        due = [g for a, g in self.admitted if a + self.eta <= v]
        if any(g.id not in rank for g in due):
            return None
        batch = list(due)
        ids = {g.id for g in batch}
        for _, _, g in sorted((a, rank[g.id], g) for a, g in self.admitted if g.id in rank and g.id not in ids):
            if len(batch) >= self.gps:
                break
            batch.append(g)
            ids.add(g.id)
        if len(batch) < self.gps:
            return None
        rest = [a + self.eta for a, g in self.admitted if g.id not in ids]
        if not self._feasible(rest, v + 1):
            return None
        return batch

    def take_ready(self) -> list[Group]:
        """Groups that join the open streaming batch of step `self.step` now: every due group, finished or not (it
        must train in this step), then finished groups in (admission version, finish order), each only while the
        groups left stay feasible for the places left; at most groups_per_step in all. The groups join `open`."""
        v = self.step
        if v >= self.steps:
            return []
        rank = {gid: i for i, gid in enumerate(self.finished)}
        out = [g for a, g in self.admitted if a + self.eta <= v]
        ids = {g.id for g in out}
        for a, _, g in sorted((a, rank[g.id], g) for a, g in self.admitted if g.id in rank and g.id not in ids):
            if len(self.open) + len(out) >= self.gps:
                break
            rest = [x + self.eta for x, h in self.admitted if h.id not in ids and h.id != g.id]
            if self._feasible(rest, v, len(self.open) + len(out) + 1):
                out.append(g)
                ids.add(g.id)
        self.admitted = [(a, g) for a, g in self.admitted if g.id not in ids]
        self.finished = [gid for gid in self.finished if gid not in ids]
        self.open += out
        return out

    def close(self) -> None:
        """The open streaming batch is complete (groups_per_step groups): the next batch is the next step's."""
        assert len(self.open) == self.gps, f"closing a batch of {len(self.open)} groups, not {self.gps}"
        self.n_trained += len(self.open)
        self.open = []
        self.step += 1

    def trained(self, batch: Sequence[Group]) -> None:
        ids = {g.id for g in batch}
        self.admitted = [(a, g) for a, g in self.admitted if g.id not in ids]
        self.finished = [gid for gid in self.finished if gid not in ids]
        self.n_trained += len(batch)
        self.step += 1


Steps = Generator[Handle, Any, Any]


def cells_of(cluster: Cluster, gpus: Sequence[int]) -> list[tuple[int, ...]]:
    """Training GPUs as cells of the cluster's `cell_gpus` (the first the core); a remainder too small for a
    cell joins the last one, and fewer GPUs than a cell are one cell."""
    gpus, c = list(gpus), cluster.cell_gpus
    cells = [tuple(gpus[i: i + c]) for i in range(0, len(gpus) - c + 1, c)] or [tuple(gpus)]
    rest = tuple(gpus[sum(len(x) for x in cells):])
    if rest:
        cells[-1] += rest
    return cells


def stream(cluster: Cluster, gpus: Sequence[int], batch: Sequence[Group]) -> tuple[Handle, list[Handle]]:
    """Train `batch` in a streaming step on `gpus`: the first cell opens it, the others join at once. Returns the
    step's handle and the joins' (a cell still switching in when the step ends is free once its join completes)."""
    cells = cells_of(cluster, gpus)
    h = cluster.open_step(cells[0], batch)
    return h, [cluster.join_step(cell) for cell in cells[1:]]


def joins_settled(joins: Sequence[Handle]) -> Steps:
    """Wait until every join of a step that ended has completed (its cell's GPUs are free then)."""
    pending = [j for j in joins if not j.done]
    if pending:
        yield all_of(pending)


def train_loop(cluster: Cluster, steps: int, batcher: Batcher, queue: AdmissionQueue, *,
               engines: Callable[[], Sequence[EngineView]], gather: Callable[[Sequence[Group]], Steps],
               after_step: Callable[[], Steps], wait: Callable[[], Sequence[Handle]] = lambda: (),
               label: str = "producer", streaming: bool = False) -> Steps:
    """The producer and train loop of a policy whose generation never stops (async, elastic).

    Producer: while the staleness bound allows, admit the next group: its executions go to `queue`
    (policies.admit_queue: handed to engines as they have room); the oldest weights among `engines()` is
    the group's version.
    Trainer: when the Batcher has a batch, `gather(batch)` yields until the step's GPUs are free and
    returns them; the step trains; `after_step()` yields until the engines serve the new weights. With
    `streaming`, a streaming step opens on those GPUs' cells as soon as any group can join its batch (a due one,
    or a finished one: `Batcher.take_ready`), and the batch fills as groups finish while it trains. Both
    sleep on the Batcher's changes and on the handles `wait()` gives (a policy's own wake-ups); `wait()`
    is called once per wake-up: the loop that sleeps second, before anything has fired, sleeps on the
    handles the first was given (a policy may react to what woke it inside `wait()`)."""
    last: list = [None, ()]  # the Batcher's change handle and the policy's handles at the last wait()

    def sleep() -> Handle:
        changed = batcher.changed.wait()
        if last[0] is not changed or not last[1] or any(h.done for h in last[1]):
            last[0], last[1] = changed, tuple(wait())
        return any_of([changed, *last[1]])

    def produce() -> Steps:
        while batcher.n_admitted < steps * batcher.gps:
            pool = list(engines())
            version = min((e.version for e in pool), default=cluster.version)
            if not pool or not batcher.can_admit(version):
                yield sleep()
                continue
            g = batcher.admit_group(version)
            batcher.watch(g, queue.submit(g.executions))

    producer = cluster.spawn(produce(), label)
    while streaming and cluster.version < steps:
        batch = batcher.take_ready()
        if not batch:
            yield sleep()
            continue
        gpus = yield from gather(batch)
        h, joins = stream(cluster, gpus, batch)
        while len(batcher.open) < batcher.gps:  # the batch fills as groups finish, while it trains
            yield sleep()
            more = batcher.take_ready()
            if more:
                cluster.extend_step(more)
        batcher.close()
        yield h
        yield from joins_settled(joins)
        yield from after_step()
        batcher.changed.fire()
    while not streaming and cluster.version < steps:
        batch = batcher.next_batch()
        if batch is None:
            yield sleep()
            continue
        batcher.trained(batch)
        gpus = yield from gather(batch)
        yield cluster.train(gpus, batch)
        yield from after_step()
        batcher.changed.fire()
    if not producer.done:
        yield any_of([producer])
