"""Waterlevel: the paper's elastic scheduler (PAPER.md, "Elastic scheduler") on cells and streaming steps.

The rule, per burst of mu = steps_per_burst steps:
1. At a burst boundary, executions are dispatched: groups are admitted while the staleness bound allows
   (policies.common.Batcher: the dispatch depth Q_b = (phi + mu) B with eta = phi + mu - 1), and queued for room
   on the rollout engines (policies.admit_queue). Nothing else is dispatched until the next boundary, so the
   outstanding work w(t) = dispatched - finished only falls within a burst.
2. The next cell in order (the core first, then the satellites) moves from rollout to training only while
   w(t) <= C_R(t) - C_e: the rollout capacity left without it still holds every outstanding execution. Moves
   are serial (one cell at a time). A moving cell takes no new execution; its live ones move to engines that
   stay on rollout longer (the standalone pool first, then the later cells), each counted at its destination
   until it arrives (`AdmissionQueue.move`); once it is empty its engines stop and it trains: the core opens the
   burst's streaming step, satellites join it.
3. Training streams: a step's batch fills with groups as they finish (Batcher.take_ready); when a step ends
   inside a burst the next opens at once on the cells already training.
4. After the burst's last step the weights are published (engines sync), the satellites return to rollout,
   the next burst is dispatched, and the core stays on training only if the next batch is ready (groups_per_step
   finished, untrained groups) and the rollout capacity without it covers the outstanding executions.

Readings of the summaries (choices the paper leaves open): C_R and C_e count executions, summed over the engines
that take work (the standalone pool's and those of cells on rollout that are not moving), each engine counted at
`capacity`, which is also the most executions it is handed:
- "share" (the default): its even share of the run's first dispatch over every engine of the cluster,
  ceil(dispatched / engines), capped at its admission limit. The rollout never runs at a higher concurrency per
  engine than when all cells roll out, so a move shortens nobody's decode; the trigger then reads "a cell's share
  of the work has finished".
- "limit": its admission limit (gyre.hardware.admission_limit: the concurrency its KV allows at the workload's
  window). Where KV holds far more executions than a burst dispatches, the core moves at once and the rest of the
  rollout runs at up to twice the concurrency, slower per execution, past more deadlines
  (experiments/paper_table/README.md measures both).
- an integer: that many executions an engine.
w counts executions dispatched and not finished, those waiting unstarted for room included. A move is
carried out with the cluster's migration (`Cluster.migrate`: at the next tool-call boundary, or at the model
request where the cluster moves requests). A cell that finishes moving after its burst's last micro-step is
trained waits for the next step. The standalone pool (`cluster.standalone_gpus`) never trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre.cluster import Cluster, ClusterError, EngineView
from gyre.handles import all_of, any_of
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Batcher, ClusterShape, Signal, engine_slots


@dataclass(frozen=True, kw_only=True)
class WaterlevelConfig:
    eta: int = 1  # staleness bound (>= steps_per_burst - 1); the dispatch depth is (eta + 1) x groups_per_step
    # what one engine counts for in C_R and C_e, and the most executions it is handed: "share" (its even share of
    # the first dispatch over every engine of the cluster), "limit" (its admission limit), or a count >= 1
    capacity: str | int = "share"

    def __post_init__(self) -> None:
        if isinstance(self.eta, bool) or not isinstance(self.eta, int) or self.eta < 0:
            raise ValueError(f"waterlevel: eta must be an integer >= 0, got {self.eta!r}")
        c = self.capacity
        if not (c in ("share", "limit") or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)):
            raise ValueError(f"waterlevel: capacity must be 'share', 'limit' or an integer >= 1, got {c!r}")


class Waterlevel:
    name = "waterlevel"
    Config = WaterlevelConfig

    def __init__(self, config: WaterlevelConfig | None = None, **params) -> None:
        self.config = config if config is not None else WaterlevelConfig(**params)
        self.eta = self.config.eta
        self.capacity = self.config.capacity

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        return [{"eta": e} for e in etas]

    def run(self, cluster: Cluster, steps: int):
        yield from _Run(cluster, steps, self.eta, self.capacity).run()


class _Run:
    """One run's state: which cells roll out, move or train; the counters; the queue and the Batcher."""

    def __init__(self, c: Cluster, steps: int, eta: int, capacity: str | int) -> None:
        self.c, self.steps = c, steps
        self.reading = capacity
        self.per_engine: int | None = capacity if isinstance(capacity, int) else None  # None: the admission limit
        self.cells = c.cells()
        if not self.cells:
            raise ClusterError(f"waterlevel: no cell of {c.cell_gpus} GPUs fits in {c.n_gpus} GPUs")
        in_cells = {g for cell in self.cells for g in cell}
        self.pool_gpus = [g for g in range(c.n_gpus) if g not in in_cells]
        self.rollout: dict[int, list[EngineView]] = {}  # cell index -> its engines, while it rolls out
        self.pool: list[EngineView] = []
        self.moving: int | None = None  # the cell being vacated (moves are serial)
        self.training: list[int] = []  # cells on training, in the order they moved (the core first)
        self.queue = AdmissionQueue(c, self.targets, limit=self.limit)
        self.batcher = Batcher(c, steps, eta)
        self.dispatched = self.finished = 0
        self.changed = Signal()
        self.joins: dict[int, object] = {}  # cell index -> its last join_step handle

    # ------------------------------------------------------------------ capacity
    def targets(self) -> list[EngineView]:
        """Engines that take work: the pool's, then those of cells on rollout and not moving, later cells first
        (a moved execution goes where it will stay longest)."""
        cells = [k for k in sorted(self.rollout, reverse=True) if k != self.moving]
        return self.pool + [e for k in cells for e in self.rollout[k]]

    def limit(self, e: EngineView) -> int:
        """The executions engine `e` counts for (and is handed at most)."""
        return e.admit_limit if self.per_engine is None else min(e.admit_limit, self.per_engine)

    def capacity(self, engines: list[EngineView]) -> int:
        return sum(self.limit(e) for e in engines)

    def outstanding(self) -> int:
        return self.dispatched - self.finished

    # ------------------------------------------------------------------ the loop
    def run(self):
        c = self.c
        gpe = c.gpus_per_engine
        slots = [(k, s) for k, cell in enumerate(self.cells) for s in engine_slots(cell, gpe)]
        slots += [(None, s) for s in engine_slots(self.pool_gpus, gpe)]
        engines = yield all_of([c.start_engine(s) for _, s in slots])
        for (k, _), e in zip(slots, engines):
            (self.pool if k is None else self.rollout.setdefault(k, [])).append(e)
        self.dispatch()
        c.spawn(self.level(), "waterlevel")
        while c.version < self.steps:
            yield from self.train_step()
            if c.version % c.steps_per_burst == 0 and c.version < self.steps:
                yield from self.boundary()

    def dispatch(self) -> None:
        """A burst boundary: admit groups while the staleness bound allows, each execution counted as it ends."""
        b, c = self.batcher, self.c
        groups = []
        while b.n_admitted < self.steps * b.gps and b.can_admit(c.published_version):
            groups.append(b.admit_group(c.published_version))
        if self.reading == "share" and self.per_engine is None:  # fixed at the first dispatch, the largest
            engines = len(self.pool) + sum(len(v) for v in self.rollout.values())
            self.per_engine = max(1, math.ceil(sum(len(g.executions) for g in groups) / engines))
            c.note("waterlevel_capacity", per_engine=self.per_engine, engines=engines)
        for g in groups:
            handles = self.queue.submit(g.executions)
            b.watch(g, handles)
            self.dispatched += len(handles)
            for h in handles:
                h.on_done(self._ended)
        self.changed.fire()

    def _ended(self, _h) -> None:
        self.finished += 1
        self.changed.fire()

    def wake(self):
        return any_of([self.changed.wait(), self.batcher.changed.wait()])

    def level(self):
        """The waterlevel trigger: move the next cell while the capacity left covers the outstanding work."""
        while self.c.version < self.steps:
            if self.moving is None and self.rollout:
                k = min(self.rollout)
                rest = self.capacity(self.targets()) - self.capacity(self.rollout[k])
                if self.outstanding() <= rest:
                    self.moving = k
                    self.c.note("waterlevel_move", cell=k, outstanding=self.outstanding(), capacity_left=rest)
                    self.c.spawn(self.vacate(k), f"vacate{k}")
                    continue
            yield self.wake()

    def vacate(self, k: int):
        """Move cell k's live executions off it, stop its engines, and hand it to training."""
        c = self.c
        engines = self.rollout[k]
        ids = {e.id for e in engines}
        sent: dict[int, object] = {}
        while any(e.n_live for e in engines):
            for x in c.live():
                if x.engine_id in ids and (x.id not in sent or sent[x.id].done):
                    dst = next((e for e in self.targets() if e.ready and self.queue.room(e) > 0), None)
                    if dst is None:
                        break
                    sent[x.id] = self.queue.move(x, dst)
            yield any_of([self.changed.wait(), *[h for h in sent.values() if not h.done]])
        yield all_of([c.stop_engine(e) for e in engines])
        del self.rollout[k]
        self.moving = None
        self.training.append(k)
        self.changed.fire()

    def train_step(self):
        """One streaming step: opened by the core once it trains and a group can join; the training satellites
        join; the batch fills as groups finish; cells that finish moving meanwhile join while there is work."""
        c, b = self.c, self.batcher
        while True:
            batch = b.take_ready() if 0 in self.training else []
            if batch:
                break
            yield self.wake()
        h = c.open_step(self.cells[0], batch)
        joined, filling = {0}, True
        while not h.done:
            if filling:
                more = b.take_ready() if len(b.open) < b.gps else []
                if more:
                    c.extend_step(more)
                if len(b.open) == b.gps:
                    b.close()
                    filling = False
            step = c.training
            busy = [j for j in self.joins.values() if not j.done]  # a join from an ended step still switching in
            for k in self.training:
                free = k not in self.joins or self.joins[k].done
                if k not in joined and free and step is not None and (step.n_untrained or filling):
                    self.joins[k] = c.join_step(self.cells[k])
                    joined.add(k)
            yield any_of([h, self.wake(), *busy])

    def boundary(self):
        """Publish; satellites back to rollout; the next dispatch; the core stays only if it may."""
        c = self.c
        yield c.sync(self.targets())
        back = [k for k in self.training if k != 0]
        yield from self.to_rollout(back)
        self.dispatch()
        if 0 in self.training:
            ready = len(self.batcher.finished)  # finished, untrained groups
            if ready < self.batcher.gps or self.outstanding() > self.capacity(self.targets()):
                yield from self.to_rollout([0])

    def to_rollout(self, cells: list[int]):
        c = self.c
        if not cells:
            return
        switching = [self.joins[k] for k in cells if k in self.joins and not self.joins[k].done]
        if switching:  # a join still switching in when its step ended: its GPUs are free once it is up
            yield all_of(switching)
        slots = [(k, s) for k in cells for s in engine_slots(self.cells[k], c.gpus_per_engine)]
        for k in cells:
            self.training.remove(k)
        engines = yield all_of([c.start_engine(s) for _, s in slots])
        for (k, _), e in zip(slots, engines):
            self.rollout.setdefault(k, []).append(e)
        self.queue.pump()
        self.changed.fire()
