"""Elastic: GPUs move between rollout and training as observed demand shifts.

Generation runs on every GPU that is not training, continuously; admission is policies.common.Batcher
(staleness <= eta). When the Batcher has a batch, the trainer needs >= min_train_gpus GPUs: free GPUs
first, then engines are drained (policies.elastic_plan: fewest live executions first) by migrating
their executions to the staying engines with the most free KV. A migration of a decoding execution
happens at its next tool-call boundary (the backend waits for it); a queued or tool-waiting one moves
at once and pays a re-prefill (or KV transfer) on the target. Nothing is aborted or restarted. When
`greedy`, every engine the live KV does not need (at `kv_fill` of capacity) is drained too, so more GPUs
train and the step is shorter. When training ends, the free GPUs start engines again (serving the new
weights) and the staying engines sync.

Trainer size (`adapt_trainer`, on by default): if the next batch is already waiting when a step ends
(trainer backlog), the next step's target doubles, up to half the pool (or the memory minimum if
larger), and that many GPUs are kept free instead of restarting engines on them; without a backlog the
target decays by one engine per step towards the minimum. `start_trainer` is where it starts: "max"
(default) at that largest size, its GPUs kept free from the start as in a fixed split, so the first
steps neither train slowly on the minimum nor wait for a drain; "min" at the memory minimum, every GPU
generating until the first batch. `decay`: "always" (default) as above; "pressure": only when rollout
showed pressure (an engine queueing, or KV above PRESSURE_FILL of capacity) since the last step ended.

Tail consolidation (`consolidate`, off by default): while admission is blocked by the staleness bound and
the live executions would fit on fewer engines at `kv_fill`, the spare engines are drained early; their
GPUs wait idle for the coming step. If demand returns first (an engine queues executions while GPUs are
idle), engines are started on the idle GPUs again (grow on demand).

Every decision reads only observations: engines' live/decoding/queued counts and KV use, the live
executions' current contexts, and the Batcher's state (trainer backlog). No future lengths.

Simplifications: one drain at a time (a drain's targets are never another drain's victims); GPUs are
taken in engine-sized pieces; the trainer's GPU count is fixed for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster, EngineView
from gyre.handles import Handle, all_of, any_of
from gyre.policies.common import Batcher, ClusterShape, Signal, engine_slots, least_loaded
from gyre.policies.elastic_plan import DrainPlan, plan_drain, spare_engines


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    eta: int = 1  # staleness bound
    greedy: bool = False  # drain every engine the live KV does not need, not only what the trainer needs
    kv_fill: float = 0.5  # fraction of KV capacity the staying engines may be filled to by a drain
    consolidate: bool = False  # drain spare engines early while admission is blocked
    adapt_trainer: bool = True  # grow the trainer under backlog, decay it otherwise
    start_trainer: str = "max"  # "max": start at the largest trainer, "min": at the memory minimum
    decay: str = "always"  # "always" or "pressure": when the trainer target shrinks

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"elastic: eta must be >= 0, got {self.eta}")
        if not 0 < self.kv_fill <= 1:
            raise ValueError(f"elastic: kv_fill must be in (0, 1], got {self.kv_fill}")
        if self.start_trainer not in ("min", "max"):
            raise ValueError(f"elastic: start_trainer must be 'min' or 'max', got {self.start_trainer!r}")
        if self.decay not in ("always", "pressure"):
            raise ValueError(f"elastic: decay must be 'always' or 'pressure', got {self.decay!r}")


class Elastic:
    name = "elastic"
    Config = ElasticConfig
    PRESSURE_FILL = 0.9  # live KV above this fraction of capacity counts as rollout pressure

    def __init__(self, config: ElasticConfig | None = None, **params) -> None:
        self.config = c = config if config is not None else ElasticConfig(**params)
        self.eta = c.eta
        self.greedy = c.greedy
        self.kv_fill = c.kv_fill
        self.consolidate = c.consolidate
        self.adapt_trainer = c.adapt_trainer
        self.start_trainer = c.start_trainer
        self.decay = c.decay
        self.pressure_seen = False  # rollout pressure observed since the last step ended

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        return [{"eta": e} for e in etas]

    # ------------------------------------------------------------------ the control loop
    def run(self, cluster: Cluster, steps: int):
        self.cluster = cluster
        self.pool: list[EngineView] = []  # engines that accept admissions (starting or ready)
        self.draining: Handle | None = None  # the one drain in flight
        self.load = Signal()  # an execution finished, or the pool changed
        self.training = False
        self.train_target = self._reserve_gpus() if self.start_trainer == "min" else self._ceil()
        self.batcher = batcher = Batcher(cluster, steps, self.eta)
        yield from self._grow()
        producer = cluster.spawn(self._produce(steps), "elastic-producer")
        while cluster.version < steps:
            batch = batcher.next_batch()
            if batch is None:
                self._react()
                yield any_of([batcher.changed.wait(), self.load.wait()])
                continue
            batcher.trained(batch)
            gpus = yield from self._gather()
            self.training = True
            cluster.note("elastic_train", gpus=len(gpus), engines=len(self.pool))
            yield cluster.train(gpus, batch)
            self.training = False
            self._adapt()
            if cluster.version < steps:
                yield from self._grow()
            batcher.changed.fire()
        if not producer.done:
            yield any_of([producer])

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
        plan = plan_drain(self.pool, cluster.live(), need, kv_fill=self.kv_fill, greedy=self.greedy)
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
        """Between steps: grow when demand returns, or consolidate a thin tail."""
        if self.training or (self.draining is not None and not self.draining.done):
            return
        cluster = self.cluster
        ready = [e for e in self.pool if e.ready]
        if len(ready) < len(self.pool):
            return
        per = cluster.gpus_per_engine
        free = len(cluster.free_gpus())
        pressure = self._pressure(ready)
        self.pressure_seen |= pressure
        if free >= per and pressure:
            self.draining = cluster.spawn(self._grow(sync=False, keep_free=self._keep()), "elastic-grow")
            return
        if pressure:
            return
        if not self.consolidate or self.batcher.can_admit():
            return
        spare = spare_engines(ready, kv_fill=self.kv_fill)
        if spare <= 0:
            return
        plan = plan_drain(ready, cluster.live(), spare * per, kv_fill=1.0)
        if plan.victims:
            self.draining = cluster.spawn(self._drain(plan, "tail"), "elastic-tail")

    def _pressure(self, ready: list[EngineView]) -> bool:
        """Rollout could use more GPUs: an engine queues executions, or the live KV is above PRESSURE_FILL."""
        return any(e.n_queued for e in ready) or sum(e.kv_used for e in ready) > self.PRESSURE_FILL * sum(
            e.kv_capacity for e in ready)

    def _adapt(self) -> None:
        """Trainer backlog: if the next batch is already waiting when a step ends, the trainer is the
        bottleneck, so the next step trains on twice the GPUs (kept free instead of restarting engines),
        up to half the pool (or the trainer's memory minimum, if larger); otherwise the target decays by
        one engine towards the minimum (with decay="pressure", only if rollout showed pressure)."""
        if not self.adapt_trainer:
            return
        cluster, per = self.cluster, self.cluster.gpus_per_engine
        floor, ceil = self._reserve_gpus(), self._ceil()
        pressure, self.pressure_seen = self.pressure_seen, False
        if cluster.version < self.batcher.steps and self.batcher.next_batch() is not None:
            self.train_target = min(ceil, 2 * self.train_target)
        elif pressure or self.decay == "always":
            self.train_target = max(floor, self.train_target - per)
        cluster.note("elastic_trainer_target", gpus=self.train_target)

    def _keep(self) -> int:
        """GPUs left free for the trainer when engines (re)start."""
        return self.train_target if self.train_target > self._reserve_gpus() else 0

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
            keep_free = self._keep() if self.pool or self.start_trainer == "max" else 0
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
