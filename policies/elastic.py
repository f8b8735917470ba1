"""Elastic: GPUs move between rollout and training as observed demand shifts.

Generation runs on every GPU that is not training, continuously; admission is policies.common.Batcher
(staleness <= eta). When the Batcher has a batch, the trainer needs >= min_train_gpus GPUs: free GPUs
first, then engines are drained (policies.elastic_plan: fewest live executions first) by migrating
their executions to the staying engines with the most free KV. A migration of a decoding execution
happens at its next tool-call boundary (the backend waits for it); a queued or tool-waiting one moves
at once and pays a re-prefill (or KV transfer) on the target. Nothing is aborted or restarted. When
training ends, the free GPUs start engines again (serving the new
weights) and the staying engines sync.

Trainer size follows what is observed, with no setting per workload. GPUs reserved for the trainer
are kept free (a fixed split's trainer) until the trainer's target says otherwise; rollout pressure (an
engine queueing executions, a KV-preempted one among them, or KV above PRESSURE_FILL of capacity) with
no batch waiting lends them to rollout (engines start on them), and they are drained back when the next
batch is ready; executions queued on one engine move to engines with KV room (`_rebalance`). The
target starts at half the pool (the memory minimum if larger) and is sized from measured times:
- the first step, before any step time is known, trains on the largest trainer: every GPU but one
  engine, whose live executions wait in its queue (their KV is recomputed later, as vLLM does) - a
  fixed split with the largest trainer, which is what a trainer-bound workload wants; so does the step
  after one that ends with the next batch already waiting, if that step was the first or every group is
  already admitted (the rollout's demand can only fall);
- later the target moves only on the evidence of the last WINDOW steps since it last moved, never on
  one step: to the largest trainer if the next batch waits, the trainer never waited in any of them
  and the finished groups waiting for it did not fall over them (trainer-bound: a burst of ready batches
  after one slow group drains that queue); to the balanced size if the trainer waited for more than half of their time
  (rollout-bound): the GPUs that train one batch in their mean batch interval (GPUs x step time /
  interval, summed over the window), shrinking at most by half per move and never below the memory
  minimum. Between the two it holds: a burst of ready batches after a slow group, or one slow batch,
  moves no GPU, and a workload whose best fixed split this is converges to it and stays;
- while drains are slow (a step waited for its GPUs longer than a quarter of its training), or while
  most running executions have not reached a tool call (a drain would wait for whole rollouts, e.g.
  single-turn ones), the largest trainer is half the pool.
Where rollout never shows pressure and the trainer is busy, no GPU moves and elastic is a fixed split.

Every decision reads only observations: engines' live/decoding/queued counts and KV use, the live
executions' current contexts, and the Batcher's state (trainer backlog). No future lengths.

Simplifications: one drain at a time (a drain's targets are never another drain's victims); GPUs are
taken in engine-sized pieces; the trainer's GPU count is fixed for the whole step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gyre.cluster import ClusterError, Cluster, EngineView, Phase
from gyre.handles import Handle, all_of, any_of
from gyre.policies.admission import ForesightParams, OrderedAdmission
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Batcher, ClusterShape, Signal, engine_slots
from gyre.policies.elastic_plan import DrainPlan, StepRecord, next_target, plan_drain


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
    WINDOW = 3  # steps the trainer target is judged on

    def __init__(self, config: ElasticConfig | None = None, **params) -> None:
        self.config = c = config if config is not None else ElasticConfig(**params)
        self.eta = c.eta
        self.kv_fill = c.kv_fill
        self.slow_drains = False  # a step waited long for its drain
        self.window: deque[StepRecord] = deque(maxlen=self.WINDOW)  # the last steps since the target moved

    def state(self) -> dict:
        """What a resumed run continues (gyre.real.resume): the step records and the trainer target they set."""
        return {"window": self.window, "slow_drains": self.slow_drains, "train_target": self.train_target}

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
        self.queue = AdmissionQueue(cluster, lambda: [e for e in self.pool if e.ready])
        yield from self._grow()
        producer = cluster.spawn(self._produce(steps), "elastic-producer")
        idle_since = cluster.now  # when the trainer last became free to train
        last_ready: float | None = None  # when the previous batch became ready
        while cluster.version < steps:
            batch = batcher.next_batch()
            if batch is None:
                self._react()
                yield any_of([batcher.changed.wait(), self.load.wait()])
                continue
            batcher.trained(batch)
            ready_at = cluster.now
            gpus = yield from self._gather(first=last_ready is None)
            self.training = True
            cluster.note("elastic_train", gpus=len(gpus), engines=len(self.pool))
            start = cluster.now
            yield cluster.train(gpus, batch)
            self.training = False
            self._adapt(idle=ready_at - idle_since, gather=start - ready_at, train=cluster.now - start,
                        gpus=len(gpus), interval=None if last_ready is None else ready_at - last_ready)
            last_ready = ready_at
            if cluster.version < steps:
                yield from self._grow()
            idle_since = cluster.now  # engines restarted and synced: from here the trainer waits for a batch
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
            handles = self.queue.submit(g.executions)
            for h in handles:
                h.on_done(self._finished)
            batcher.watch(g, handles)

    def _finished(self, _h: Handle) -> None:
        self.load.fire()

    # ------------------------------------------------------------------ shrink
    def _gather(self, first: bool = False):
        """GPUs for the coming step: free ones, then drained engines. Returns the GPU list. The first step
        (no step time observed yet) takes the largest trainer."""
        cluster = self.cluster
        while self.draining is not None and not self.draining.done:
            yield self.draining
        while any(not e.ready for e in self.pool):  # engines still starting cannot be drained yet
            yield any_of([self.load.wait(), cluster.timeout(1.0)])
        if first:
            self.train_target = max(self.train_target, self._top())
        need = max(0, max(cluster.min_train_gpus, self.train_target) - len(cluster.free_gpus()))
        plan = plan_drain(self.pool, cluster.live(), need, kv_fill=self.kv_fill, slots=self.queue.room)
        if plan.victims:
            yield from self._drain(plan, "train")
        return cluster.free_gpus()

    def _drain(self, plan: DrainPlan, why: str):
        cluster = self.cluster
        ids = {e.id for e in plan.victims}
        self.pool = [e for e in self.pool if e.id not in ids]
        cluster.note("elastic_drain", why=why, engines=sorted(ids), moves=len(plan.moves))
        yield all_of([self.queue.move(x, t) for x, t in plan.moves] + [self.queue.park(x) for x in plan.parks])
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
        if not self._pressure(ready):
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
        room = {e.id: self.kv_fill * e.kv_capacity - e.kv_used for e in ready
                if not e.n_queued and self.queue.room(e) > 0}
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
            if self.queue.room(by_id[tid]) <= 1:
                del room[tid]
            self.queue.move(x, by_id[tid])
            if not room:
                return

    def _pressure(self, ready: list[EngineView]) -> bool:
        """Rollout could use more GPUs: executions wait for room (policies.admit_queue), an engine queues
        executions (a preempted one waits in the queue too), or the live KV is above PRESSURE_FILL of capacity."""
        return len(self.queue) > 0 or any(e.n_queued for e in ready) or sum(
            e.kv_used for e in ready) > self.PRESSURE_FILL * sum(e.kv_capacity for e in ready)

    def _adapt(self, idle: float, gather: float, train: float, gpus: int, interval: float | None) -> None:
        """After a step (the trainer waited `idle` for the batch, `gather` for its GPUs, trained `train` on
        `gpus`; `interval` between this batch becoming ready and the previous one, None after the first):
        - a gather longer than a quarter of the training it fed marks drains slow for the rest of the run;
        - after the first step, or once every group is admitted, a waiting batch (backlog) makes the
          target the largest trainer (`_top`);
        - otherwise the steps since the target last moved decide (`elastic_plan.next_target`);
        - with slow drains the target never exceeds the largest trainer, then half the pool."""
        cluster, per = self.cluster, self.cluster.gpus_per_engine
        if gather > train / 4:
            self.slow_drains = True
        top = self._top()
        backlog = cluster.version < self.batcher.steps and self.batcher.next_batch() is not None
        tail = self.batcher.n_admitted >= self.batcher.steps * self.batcher.gps  # nothing left to admit
        target = self.train_target
        if interval is not None:
            self.window.append(StepRecord(interval=interval, idle=idle, train=train, gpus=gpus,
                                          waiting=len(self.batcher.finished)))
        if backlog and (interval is None or tail):
            target = top
        elif interval is not None:
            target = next_target(self.train_target, self.window, backlog=backlog, top=top,
                                 floor=self._reserve_gpus(), per=per, size=self.WINDOW)
        if self.slow_drains:
            target = min(target, top)
        if target != self.train_target:
            self.window.clear()
        self.train_target = target
        cluster.note("elastic_trainer_target", gpus=self.train_target)

    def _keep(self) -> int:
        """GPUs reserved for the trainer when engines (re)start."""
        return self.train_target

    def _top(self) -> int:
        """The largest trainer: every GPU but one engine; half the pool (`_ceil`) while drains are slow or
        while most running executions have not passed a tool call yet (a decoding execution moves only at
        a tool-call boundary, so draining engines full of first turns, e.g. single-turn rollouts, waits
        for whole rollouts)."""
        cluster, per = self.cluster, self.cluster.gpus_per_engine
        started = [x for x in cluster.live() if x.phase != Phase.QUEUED]
        if self.slow_drains or 2 * sum(1 for x in started if x.turns_done >= 1) < len(started):
            return self._ceil()
        return max(self._ceil(), (cluster.n_gpus - per) // per * per)

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
        self.queue.pump()
        self.load.fire()
