"""Elastic: GPUs move between rollout and training as observed demand shifts.

Generation runs on every GPU that is not training, continuously; admission is policies.common.Batcher
(staleness <= eta). When the Batcher has a batch, the trainer needs >= min_train_gpus GPUs: free GPUs
first, then engines are drained (policies.elastic_plan: fewest live executions first) by migrating
their executions to the staying engines with the most free KV. A migration of a decoding execution
happens at its next tool-call boundary (the backend waits for it); a queued or tool-waiting one moves
at once and pays a re-prefill (or KV transfer) on the target. Nothing is aborted or restarted. When
training ends, the free GPUs start engines again (serving the new
weights) and the staying engines sync.

Trainer size follows what is observed, with no setting per workload. The trainer's target starts at
its largest size (half the pool, or the memory minimum if larger) and those GPUs are reserved: kept
free for the trainer, as a fixed split would, so a trainer-bound run never waits for a drain or trains
slowly on the minimum. Rollout pressure (an engine queueing executions, a KV-preempted one among them,
or KV above PRESSURE_FILL of capacity) is demand for engines: while it lasts and no batch is
waiting, reserved GPUs start engines (lent to rollout), and they are drained back when the next batch
is ready; executions queued on one engine move to engines with KV room (`_rebalance`). After each
step: if the next batch was already waiting (trainer backlog), the target doubles up to the largest
size, and past it (up to every GPU the live executions' KV does not need at `kv_fill`) while drains
prove quick (`_adapt`); else, if rollout showed pressure since the last step, or drains are quick and
the trainer waited for its batch longer than the step took twice in a row, it halves towards the
minimum; else it stays. Where rollout never
shows pressure and the trainer is busy, no GPU moves and elastic is the fixed split with the largest
trainer.

Every decision reads only observations: engines' live/decoding/queued counts and KV use, the live
executions' current contexts, and the Batcher's state (trainer backlog). No future lengths.

Simplifications: one drain at a time (a drain's targets are never another drain's victims); GPUs are
taken in engine-sized pieces; the trainer's GPU count is fixed for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import ClusterError, Cluster, EngineView, Phase
from gyre.handles import Handle, all_of, any_of
from gyre.policies.admission import ForesightParams, OrderedAdmission
from gyre.policies.common import Batcher, ClusterShape, Signal, engine_slots, least_loaded
from gyre.policies.elastic_plan import DrainPlan, plan_drain


@dataclass(frozen=True, kw_only=True)
class ElasticConfig(ForesightParams):
    eta: int = 1  # staleness bound
    kv_fill: float = 0.5  # fraction of KV capacity the staying engines may be filled to by a drain

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta < 0:
            raise ValueError(f"elastic: eta must be >= 0, got {self.eta}")
        if not 0 < self.kv_fill <= 1:
            raise ValueError(f"elastic: kv_fill must be in (0, 1], got {self.kv_fill}")


class Elastic:
    name = "elastic"
    Config = ElasticConfig
    PRESSURE_FILL = 0.9  # live KV above this fraction of capacity counts as rollout pressure

    def __init__(self, config: ElasticConfig | None = None, **params) -> None:
        self.config = c = config if config is not None else ElasticConfig(**params)
        self.eta = c.eta
        self.kv_fill = c.kv_fill
        self.pressure_seen = False  # rollout pressure observed since the last step ended
        self.slow_drains = False  # a step waited long for its drain
        self.idle_streak = 0  # consecutive steps whose trainer waited longer for its batch than the step took

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        fits = shape.n_gpus >= shape.min_train_gpus + shape.gpus_per_engine
        return [{"eta": e} for e in etas] if fits else []

    # ------------------------------------------------------------------ the control loop
    def run(self, cluster: Cluster, steps: int):
        per, need, n = cluster.gpus_per_engine, cluster.min_train_gpus, cluster.n_gpus
        if n < need + per:  # the trainer and one engine must fit side by side
            raise ClusterError(f"elastic: needs >= {need + per} GPUs (a trainer of {need} beside an engine of {per}), "
                               f"the cluster has {n}")
        self.cluster = cluster
        self.pool: list[EngineView] = []  # engines that accept admissions (starting or ready)
        self.draining: Handle | None = None  # the one drain in flight
        self.load = Signal()  # an execution finished, or the pool changed
        self.training = False
        self.train_target = self._ceil()
        order = OrderedAdmission(cluster, steps, self.config)
        self.batcher = batcher = Batcher(cluster, steps, self.eta, order)
        yield from self._grow()
        producer = cluster.spawn(self._produce(steps), "elastic-producer")
        idle_since = cluster.now  # when the trainer last became free
        while cluster.version < steps:
            batch = batcher.next_batch()
            if batch is None:
                self._react()
                yield any_of([batcher.changed.wait(), self.load.wait()])
                continue
            batcher.trained(batch)
            ready_at = cluster.now
            gpus = yield from self._gather()
            self.training = True
            cluster.note("elastic_train", gpus=len(gpus), engines=len(self.pool))
            start = cluster.now
            yield cluster.train(gpus, batch)
            self.training = False
            self._adapt(idle=ready_at - idle_since, gather=start - ready_at, train=cluster.now - start)
            idle_since = cluster.now
            if cluster.version < steps:
                yield from self._grow()
            batcher.changed.fire()
        if not producer.done:
            yield any_of([producer])
        order.report()

    def _produce(self, steps: int):
        """Admit groups while the staleness bound allows, each execution to the least-loaded engine."""
        cluster, batcher = self.cluster, self.batcher
        while batcher.n_admitted < steps * batcher.gps:
            ready = [e for e in self.pool if e.ready]
            version = min((e.version for e in self.pool), default=cluster.version)  # oldest weights a member may run on
            if not ready or not batcher.can_admit(version):
                yield any_of([batcher.changed.wait(), self.load.wait()])
                continue
            g = batcher.admit_group(version)
            handles = [cluster.admit(x, least_loaded(ready)) for x in g.executions]
            for h in handles:
                h.on_done(self._finished)
            batcher.watch(g, handles)

    def _finished(self, _h: Handle) -> None:
        self.load.fire()

    # ------------------------------------------------------------------ shrink
    def _gather(self):
        """GPUs for the coming step: free ones, then drained engines. Returns the GPU list."""
        cluster = self.cluster
        while self.draining is not None and not self.draining.done:
            yield self.draining
        while any(not e.ready for e in self.pool):  # engines still starting cannot be drained yet
            yield any_of([self.load.wait(), cluster.timeout(1.0)])
        need = max(0, max(cluster.min_train_gpus, self.train_target) - len(cluster.free_gpus()))
        plan = plan_drain(self.pool, cluster.live(), need, kv_fill=self.kv_fill)
        if plan.victims:
            yield from self._drain(plan, "train")
        return cluster.free_gpus()

    def _drain(self, plan: DrainPlan, why: str):
        cluster = self.cluster
        ids = {e.id for e in plan.victims}
        self.pool = [e for e in self.pool if e.id not in ids]
        cluster.note("elastic_drain", why=why, engines=sorted(ids), moves=len(plan.moves))
        yield all_of([cluster.migrate(x, t) for x, t in plan.moves])
        yield all_of([cluster.stop_engine(e) for e in plan.victims])
        self.load.fire()

    def _react(self) -> None:
        """Between steps: rollout pressure with no batch waiting starts engines on free GPUs, reserved ones too."""
        if self.training or (self.draining is not None and not self.draining.done):
            return
        cluster = self.cluster
        ready = [e for e in self.pool if e.ready]
        if len(ready) < len(self.pool):
            return
        pressure = self._pressure(ready)
        self.pressure_seen |= pressure
        if not pressure:
            return
        if len(cluster.free_gpus()) >= cluster.gpus_per_engine and self.batcher.next_batch() is None:
            self.draining = cluster.spawn(self._lend(), "elastic-grow")
            return
        self._rebalance(ready)

    def _lend(self):
        """Start engines on every free GPU, reserved ones too, then move queued executions onto them."""
        yield from self._grow(sync=False, keep_free=0)
        self._rebalance([e for e in self.pool if e.ready])

    def _rebalance(self, ready: list[EngineView]) -> None:
        """Executions queued on an engine move to engines that queue nothing and have KV room (below
        kv_fill after the move), largest context first: no engine idles while another queues."""
        room = {e.id: self.kv_fill * e.kv_capacity - e.kv_used for e in ready if not e.n_queued}
        if not room or max(room.values()) <= 0:
            return
        full = {e.id for e in ready if e.n_queued}
        queued = [x for x in self.cluster.live() if x.phase == Phase.QUEUED and x.engine_id in full]
        by_id = {e.id: e for e in ready}
        for x in sorted(queued, key=lambda x: (-x.context_tokens, x.id)):
            tid = max(room, key=lambda i: (room[i], -i))
            need = max(x.context_tokens, 1)
            if room[tid] < need:
                continue
            room[tid] -= need
            self.cluster.migrate(x, by_id[tid])

    def _pressure(self, ready: list[EngineView]) -> bool:
        """Rollout could use more GPUs: an engine queues executions (a preempted one waits in the queue too),
        or the live KV is above PRESSURE_FILL of capacity."""
        return any(e.n_queued for e in ready) or sum(e.kv_used for e in ready) > self.PRESSURE_FILL * sum(
            e.kv_capacity for e in ready)

    def _adapt(self, idle: float, gather: float, train: float) -> None:
        """After a step (the trainer waited `idle` for the batch, `gather` for its GPUs, trained `train`):
        - a gather longer than a quarter of the training it fed marks drains slow for the rest of the run;
        - backlog (the next batch already waits): the target doubles, up to the largest size, and past it
          (up to every GPU the live KV does not need) only while drains are not slow;
        - otherwise rollout pressure since the last step, or (while drains are not slow: growing back
          would cost one) a trainer that waited longer for its batch than it then spent on the step,
          twice in a row, halves it (down to the memory minimum); otherwise it stays;
        - with slow drains the target never exceeds the largest size."""
        cluster, per = self.cluster, self.cluster.gpus_per_engine
        floor, ceil = self._reserve_gpus(), self._ceil()
        pressure, self.pressure_seen = self.pressure_seen, False
        if gather > train / 4:
            self.slow_drains = True
        self.idle_streak = self.idle_streak + 1 if idle > gather + train else 0
        if cluster.version < self.batcher.steps and self.batcher.next_batch() is not None:
            top = ceil if self.slow_drains else self._cap()
            self.train_target = min(max(top, ceil), 2 * self.train_target)
        elif pressure or (self.idle_streak >= 2 and not self.slow_drains):
            self.train_target = max(floor, self.train_target // 2 // per * per)
        if self.slow_drains:
            self.train_target = min(self.train_target, ceil)
        cluster.note("elastic_trainer_target", gpus=self.train_target)

    def _keep(self) -> int:
        """GPUs reserved for the trainer when engines (re)start."""
        return self.train_target

    def _cap(self) -> int:
        """The most the trainer may grow to: every GPU but the engines the live executions' KV needs (at
        kv_fill of capacity; at least one engine), and never below the starting size. Only the starting
        size while most live executions have not passed a tool call yet (a decoding execution moves only
        at a tool-call boundary, so draining engines full of first turns, e.g. single-turn rollouts, waits
        for whole rollouts)."""
        cluster, per = self.cluster, self.cluster.gpus_per_engine
        live = cluster.live()
        if 2 * sum(1 for x in live if x.turns_done >= 1) < len(live):
            return self._ceil()  # most executions have not reached a tool call: a drain would wait for them
        ready = [e for e in self.pool if e.ready]
        cap = max((e.kv_capacity for e in ready), default=0) * self.kv_fill
        kv = sum(e.kv_used for e in ready) + sum(max(x.context_tokens, 0) for x in live if x.phase == Phase.QUEUED)
        engines = max(1, -(-int(kv) // int(cap))) if cap > 0 else 1
        return max(self._ceil(), (cluster.n_gpus - engines * per) // per * per)

    def _ceil(self) -> int:
        """The largest trainer: half the pool (or the memory minimum, if larger)."""
        per = self.cluster.gpus_per_engine
        return max(self._reserve_gpus(), self.cluster.n_gpus // 2 // per * per)

    def _reserve_gpus(self) -> int:
        per = self.cluster.gpus_per_engine
        return -(-self.cluster.min_train_gpus // per) * per

    # ------------------------------------------------------------------ grow
    def _grow(self, sync: bool = True, keep_free: int | None = None):
        """Start engines on the free GPUs but `keep_free` (latest weights); sync the staying engines."""
        cluster = self.cluster
        if keep_free is None:
            keep_free = self._keep()
        free = sorted(cluster.free_gpus())
        slots = engine_slots(free[: max(0, len(free) - keep_free)], cluster.gpus_per_engine)
        stale = [e for e in self.pool if e.ready and e.version < cluster.version] if sync else []
        if slots:
            cluster.note("elastic_grow", engines=len(slots))
        if not slots and not stale:
            return
        waits = [cluster.start_engine(s) for s in slots]
        if stale:
            waits.append(cluster.sync(stale))
        done = yield all_of(waits)
        self.pool.extend(done[: len(slots)])
        self.load.fire()
