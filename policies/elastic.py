"""Elastic: a controller that moves GPUs between rollout and training, from a model of what each costs.

Generation never stops and admission is async's (policies.common.train_loop: the Batcher keeps
staleness <= eta). The controller observes the engines' load, the live executions' progress, what
finished executions showed (their segments and seconds per segment: policies.elastic_plan.History) and
the cluster's cost estimate (gyre.estimate: a training step's seconds on g GPUs, an engine's decode
throughput at n sequences, KV capacity, engine size, the trainer's memory minimum). It never sees a
future length. At the start every GPU runs an engine; then at each decision point it does one thing:

1. A batch is ready (the first one too). For each trainer size the free GPUs plus the first k engines of the drain order
   allow (fewest live executions first; at least one engine stays; at least the memory minimum), predict
   - when the step ends: the slowest migrant's wait for its tool-call boundary (a decoding execution is
     `boundary_share` of a segment from one, or its finish if its segment is expected to be its last;
     others move at once), then the batch's training time from the estimate;
   - when each live execution finishes: its expected remaining segments given the finished ones, times
     its own seconds per segment (before it has finished one: the finished ones' mean, times its
     engine's step time at its load over theirs), stretched by the estimate's step time of the engine it ends up on
     over that of its engine now; one no staying engine has room for (KV below `kv_fill` of capacity, a
     slot under the admission limit) is parked and resumes in the next slot a staying execution frees
     (their predicted finishes, in order), or when the step ends and engines restart;
   - so when each later batch of the groups admitted so far is ready (the groups the staleness bound
     makes due first, then in order of predicted finish; queued executions take finished durations in
     start order), and when the last of them is trained (each batch as long as this one, once it is ready and
     the trainer free);
   - how many more executions its delays are expected to push past their deadline (each execution's
     budget is observed; the probability from the Kaplan-Meier segment distribution);
   and, among the sizes expected to cut at most `cut_share` of a step's executions more than the
   least-cutting one (a cut is lost work, never a speed-up), train on the one that trains that last
   group soonest (ties: the sooner step end, then the larger trainer). Its engines are drained: executions
   migrate at their next tool-call boundary, never aborted; those with no room are parked there and
   resumed where room frees (policies.admit_queue).
2. A step ends. The number of engines to start on the freed GPUs is predicted the same way
   (policies.elastic_plan.choose_grow): the executions waiting to start (and the groups the staleness
   bound lets in next) take engine slots as they free, each taking what finished executions took,
   scaled by the estimate's step time at the load that many engines carry; the GPUs left free train the
   next steps; the count whose last pending group is trained soonest wins (ties: fewer). With no engine
   ready, every freed GPU starts one. Engines serving old weights sync.
3. An execution finishes or the pool changes, with no batch ready. Free GPUs start engines if executions
   wait for room, and executions queued on one engine move to engines with room. An engine whose live
   executions have fallen below `load_share` of the most it held, while nothing waits for room, is
   drained if every one of its executions fits elsewhere and the drain frees it sooner than their
   finishes would (a single-turn rollout reaches no boundary: draining it frees nothing sooner and would
   hold up the next decision; all such engines at once): the tail is consolidated and its GPUs wait free
   for the next step.

Every threshold is an `ElasticConfig` field with its reason. Simplifications: one drain at a time;
GPUs are taken in engine-sized pieces; a step's GPU count is fixed for the step.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from gyre.cluster import Cluster, ClusterError, EngineView, Phase
from gyre.estimate import batch_counts
from gyre.handles import Handle, all_of, any_of
from gyre.policies.admission import ForesightParams, OrderedAdmission
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Batcher, ClusterShape, Signal, engine_slots, train_loop
from gyre.policies.elastic_plan import (Candidate, DrainPlan, History, boundary_wait_s, choose, choose_grow,
                                        cut_p, frees_sooner, evaluate, plan_drain, remaining_s)


@dataclass(frozen=True, kw_only=True)
class ElasticConfig(ForesightParams):
    eta: int = 1  # staleness bound: the learning algorithm's choice
    # a staying engine is filled by migrants to at most this share of its KV: a live context about doubles
    # before it ends (its expected remaining length equals its length so far, as `unseen_residual` assumes)
    kv_fill: float = 0.5
    # an execution longer than every finished one expects this many times its segments so far still to
    # come: the mean residual life of a heavy (Pareto, index 2) tail grows as its age
    unseen_residual: float = 1.0
    # a decoding execution asked to move is expected this share of a segment from its next tool call
    # (uniformly far into its current segment)
    boundary_share: float = 0.5
    # an engine holding less than this share of the most executions it held is consolidated onto others:
    # a quarter of a full engine's load re-prefills little and leaves the targets most of their room
    load_share: float = 0.25
    # a trainer size may be expected to cut this share of a step's executions more than the least-cutting
    # size: equal work allows 1% of a run's executions (DESIGN.md), one decision per step spends 1% of a step's
    cut_share: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta < 0:
            raise ValueError(f"elastic: eta must be >= 0, got {self.eta}")
        for name in ("kv_fill", "boundary_share", "load_share", "cut_share"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"elastic: {name} must be in (0, 1], got {v}")
        if not 0 < self.unseen_residual < float("inf"):
            raise ValueError(f"elastic: unseen_residual must be a positive number, got {self.unseen_residual}")


class Elastic:
    name = "elastic"
    Config = ElasticConfig

    def __init__(self, config: ElasticConfig | None = None, **params) -> None:
        self.config = config if config is not None else ElasticConfig(**params)
        self.eta = self.config.eta

    def state(self) -> dict:
        """What a resumed real run continues (docs/writing-a-policy.md): the finished executions' and groups' records."""
        return {k: getattr(self, k) for k in ("segs", "ctx", "seg_s", "started_durations", "group_size",
                                              "seen_step", "last_counts", "max_ctx")}

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
        self.est = cluster.estimate
        self.pool: list[EngineView] = []  # engines that accept admissions (starting or ready)
        self.peak: dict[int, int] = {}  # engine id -> the most live executions it held
        self.draining: Handle | None = None  # the one drain in flight
        self.load = Signal()  # an execution finished, or the pool changed
        self.steps = steps
        self.gathering = False  # a batch's GPUs are being gathered
        self.segs: list[int] = []  # segments of each finished execution
        self.ctx: list[float] = []  # its mean context over its life
        self.seg_s: list[float] = []  # its seconds per segment
        # its seconds from first run to finish, keyed by (first run, id): kept in start order, a sample of
        # the lengths independent of them (in finish order the first are the shortest, and cycling those
        # over a batch's queued executions would predict its last finish far too soon)
        self.started_durations: list[tuple[float, int, float]] = []
        self.group_of: dict[int, int] = {}  # execution id -> group id
        self.group_size = 1  # executions per group (as the groups admitted show)
        self.seen_step = [0.0, 0]  # sum and count of the mean engine step time sampled at finishes
        self.last_counts = (0.0, 0.0)
        self.max_ctx = 0  # the largest context seen on a live execution (what compaction bounds contexts at)  # the last batch's trained tokens and attention sum
        order = OrderedAdmission(cluster, steps, self.config)
        self.batcher = batcher = Batcher(cluster, steps, self.eta, order)
        self.queue = AdmissionQueue(cluster, self._admit_to)
        self._watch_groups(batcher)
        yield from self._grow(sync=False)  # rollout has the whole pool until there is something to train
        yield from train_loop(cluster, steps, batcher, self.queue, engines=self._admit_to, gather=self._gather,
                              after_step=self._after_step, wait=self._react, label="elastic-producer")
        order.report()

    def _admit_to(self) -> list[EngineView]:
        return [e for e in self.pool if e.ready]

    def _watch_groups(self, batcher: Batcher) -> None:
        """Record what each finished execution and group showed (the History the predictions use)."""
        watch = batcher.watch

        def watched(group, handles):
            watch(group, handles)
            self.group_size = len(group.executions)
            for x in group.executions:
                self.group_of[x.id] = group.id

            def one(h: Handle) -> None:
                self._sample_load()
                self.load.fire()
                if h.error is not None:
                    return
                x = h.value
                segs = x.turns_done + 1
                t0 = x.started_at if x.started_at is not None else self.cluster.now
                self.segs.append(segs)
                self.ctx.append(0.5 * x.trajectory_tokens)
                self.seg_s.append((self.cluster.now - t0) / segs)
                bisect.insort(self.started_durations, (t0, x.id, self.cluster.now - t0))

            for h in handles:
                h.on_done(one)

        batcher.watch = watched

    def _durations(self) -> list[float]:
        """What finished executions took, in the order they started (see `started_durations`)."""
        return [d for _, _, d in self.started_durations]

    def _sample_load(self) -> None:
        """The mean engine step time (the estimate's, at each ready engine's load) as an execution finishes:
        the load the finished groups' durations were measured at."""
        ready = [e for e in self.pool if e.ready and e.n_live]
        if ready:
            self.seen_step[0] += sum(self.est.step_s(e.n_live, e.kv_used) for e in ready) / len(ready)
            self.seen_step[1] += 1

    def _history(self) -> History:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return History(segments=tuple(sorted(self.segs)), seg_s=mean(self.seg_s), ctx=mean(self.ctx),
                       live_done=tuple(x.turns_done for x in self.cluster.live()))

    # ------------------------------------------------------------------ 1. a batch is ready
    def _gather(self, batch):
        """The step's GPUs: the candidate size the rule picks (module docstring, 1), its engines drained."""
        cluster = self.cluster
        self.gathering = True  # the GPUs being freed are the trainer's: no engine starts on them
        while True:
            while self.draining is not None and not self.draining.done:
                yield self.draining
            best = self._choose(batch)
            if best is not None:
                break
            # engines restarting after a fault: no trainer fits until one is back, which takes at least an
            # engine start (and any engine at least a step)
            yield any_of([self.load.wait(), cluster.timeout(self.est.engine_start_s or self.est.step_s(1, 0))])
        cluster.note("elastic_train", gpus=best.gpus, engines=len(self.pool) - len(best.plan.victims),
                     step_end=round(best.step_end, 3), next_ready=round(best.next_ready, 3))
        if best.plan.victims:
            yield from self._drain(best.plan, "train")
        self.gathering = False
        return cluster.free_gpus()

    def _predict(self, hist: History):
        """Each live execution's predicted finish (absolute) and wait for its next tool-call boundary."""
        c, now = self.config, self.cluster.now
        finish, waits = {}, {}
        load = self._loads()
        for x in self.cluster.live():
            f = load.get(x.engine_id, 1.0)
            rem = remaining_s(x, hist, now, c.unseen_residual, f)
            finish[x.id] = now + rem
            waits[x.id] = boundary_wait_s(x, hist, now, rem, c.boundary_share, c.unseen_residual, f)
        return finish, waits

    def _loads(self) -> dict[int, float]:
        """Each ready engine's step time now (the estimate's, at its load) over the mean one the finished
        executions were measured at (policies.elastic_plan.seg_s)."""
        seen = self.seen_step[0] / max(self.seen_step[1], 1)
        if seen <= 0:
            return {}
        return {e.id: self.est.step_s(e.n_live, e.kv_used) / seen for e in self.pool if e.ready and e.n_live}

    def _scale(self, ready: list[EngineView], n_queued: int, hist: History):
        """scale(n): the estimate's engine step time with the live and queued executions spread over n
        engines (at most each one's admission limit), over the step time the finished ones were measured at."""
        est = self.est
        limit = max((e.admit_limit for e in ready), default=1)
        n_work = sum(e.n_live for e in ready) + n_queued
        seen = self.seen_step[0] / max(self.seen_step[1], 1)

        def scale(n_engines: int) -> float:
            n = min(n_work, n_engines * limit) / n_engines
            return est.step_s(n, n * hist.ctx) / seen if seen > 0 and n > 0 else 1.0

        return scale

    def _pending(self, exclude: set[int] = frozenset()) -> tuple[list[int], list[int], list[int]]:
        """The untrained groups (ids; those still to be admitted, up to what the staleness bound lets in
        next, get ids below 0), the group id of each execution waiting to start, in order, and each pending
        group's batch index among the coming ones by the staleness bound (admitted at version a: due at
        step a + eta; one still to be admitted joins at the next version)."""
        b = self.batcher
        pending = [g.id for _, g in b.admitted if g.id not in exclude]
        due = [max(0, a + self.eta - b.step) for a, g in b.admitted if g.id not in exclude]
        queued = [x.group_id for x, _ in self.queue.waiting]
        new = max(0, min(b.steps * b.gps - b.n_admitted, (self.eta + 1) * b.gps - len(b.admitted)))
        for i in range(new):
            pending.append(-1 - i)
            due.append(self.eta)
            queued += [-1 - i] * self.group_size
        return pending, queued, due

    def _choose(self, batch) -> Candidate | None:
        cluster, est, c = self.cluster, self.est, self.config
        now, hist = cluster.now, self._history()
        live = cluster.live()
        finish, waits = self._predict(hist)
        self.max_ctx = max([self.max_ctx] + [x.context_tokens for x in live])
        tokens, attn = self.last_counts = batch_counts((x for g in batch for x in g.executions), self.max_ctx or math.inf)
        in_batch = {g.id for g in batch}
        pending, queued, due = self._pending(exclude=in_batch)
        ready = [e for e in self.pool if e.ready]
        free = len(cluster.free_gpus())

        scale = self._scale(ready, len(queued), hist)

        load = self._loads()

        def risk(x, delay: float, stretch: float) -> float:
            return cut_p(x, hist, now, c.unseen_residual, delay, stretch, load.get(x.engine_id, 1.0))

        cands = []
        for k in range(len(ready)):
            plan = plan_drain(ready, live, k, kv_fill=c.kv_fill, slots=self.queue.room)
            if len(plan.victims) < k:
                break
            g = free + len(plan.gpus)
            if g < cluster.min_train_gpus:
                continue
            train = est.train_s(tokens, attn, g) + (est.trainer_start_s if plan.victims else 0.0)
            cands.append(evaluate(plan, gpus=g, now=now, train_s=train, finish=finish,
                                  waits_s=waits, engines=ready, live=live, group_of=self.group_of, pending=pending,
                                  finished=set(self.batcher.finished), n_next=self.batcher.gps, queued=queued,
                                  durations=self._durations(), step_s=est.step_s, stop_s=est.engine_stop_s,
                                  start_s=est.engine_start_s, risk=risk, scale=scale, due=due))
        tol = c.cut_share * self.batcher.gps * self.group_size
        return choose(cands, tol) if cands else None

    def _drain(self, plan: DrainPlan, why: str):
        """Empty the plan's engines (moves, parks), then stop them. An execution still on one once its move
        is done (it was moved back by a fault's restart, or joined meanwhile) is parked."""
        cluster = self.cluster
        ids = {e.id for e in plan.victims}
        self.pool = [e for e in self.pool if e.id not in ids]
        cluster.note("elastic_drain", why=why, engines=sorted(ids), moves=len(plan.moves), parks=len(plan.parks))
        yield all_of([self.queue.move(x, t) for x, t in plan.moves] + [self.queue.park(x) for x in plan.parks])
        left = [x for x in cluster.live() if x.engine_id in ids]
        while left:
            yield all_of([self.queue.park(x) for x in left])
            left = [x for x in cluster.live() if x.engine_id in ids]
        yield all_of([cluster.stop_engine(e) for e in plan.victims])
        self.draining = None  # done: whoever wakes on the pool's change may start the next drain
        self.load.fire()

    # ------------------------------------------------------------------ 2. a step ends
    def _after_step(self):
        if self.cluster.version < self.steps:
            yield from self._grow(sync=True, engines=self._engines_to_start())

    def _engines_to_start(self) -> int:
        """How many engines to start on the free GPUs (policies.elastic_plan.choose_grow)."""
        cluster, est, b = self.cluster, self.est, self.batcher
        ready = [e for e in self.pool if e.ready]
        per, free = cluster.gpus_per_engine, len(cluster.free_gpus())
        if not ready:
            return free // per
        hist, now = self._history(), cluster.now
        finish, _ = self._predict(hist)
        ends: dict[int, float] = {}
        for x in cluster.live():
            gid = self.group_of[x.id]
            ends[gid] = max(ends.get(gid, now), finish[x.id])
        pending, queued, due = self._pending()
        tokens, attn = self.last_counts
        last = hist.segments[-1] if hist.segments else 1
        drain = hist.seg_s * (1 if last <= 1 else self.config.boundary_share)
        limit = max(e.admit_limit for e in ready)
        scale = self._scale(ready, len(queued), hist)
        return choose_grow(now=now, free_gpus=free, per=per, min_train=cluster.min_train_gpus, engines=len(ready),
                           limit=limit, live_free_at=list(finish.values()),
                           unused_slots=sum(max(0, e.admit_limit - e.n_live) for e in ready), live_ends=ends,
                           pending=pending, finished=set(b.finished), queued=queued, durations=self._durations(),
                           scale=scale, per_batch=b.gps, train_s=lambda g: est.train_s(tokens, attn, g) + est.trainer_start_s,
                           start_s=est.engine_start_s, drain_s=drain + est.engine_stop_s, due=due)

    def _waiting_for_room(self) -> bool:
        """Executions wait for room: unstarted or parked in the admission queue, or queued on an engine."""
        return len(self.queue) > 0 or any(e.n_queued for e in self.pool if e.ready)

    def _grow(self, sync: bool = True, engines: int | None = None):
        """Start `engines` engines (None: as many as the free GPUs hold) on the free GPUs; sync stale engines."""
        cluster = self.cluster
        slots = engine_slots(sorted(cluster.free_gpus()), cluster.gpus_per_engine)
        slots = slots if engines is None else slots[:engines]
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

    # ------------------------------------------------------------------ 3. an execution finishes
    def _react(self) -> list[Handle]:
        """Between decisions: grow on free GPUs where executions wait for room, rebalance queues, consolidate
        a thinning engine. Returns the handles the loop also wakes on."""
        cluster = self.cluster
        if self.gathering:
            return [self.load.wait()]
        idle = self.draining is None or self.draining.done
        ready = [e for e in self.pool if e.ready]
        for e in ready:
            self.peak[e.id] = max(self.peak.get(e.id, 0), e.n_live)
        if idle and len(ready) == len(self.pool) and self.batcher.next_batch() is None:
            if self._waiting_for_room():
                if len(cluster.free_gpus()) >= cluster.gpus_per_engine:
                    self.draining = cluster.spawn(self._lend(), "elastic-grow")
                else:
                    self._rebalance(ready)
            else:
                self._consolidate(ready)
        return [self.load.wait()]

    def _lend(self):
        yield from self._grow(sync=False)
        self._rebalance([e for e in self.pool if e.ready])
        self.draining = None
        self.load.fire()

    def _rebalance(self, ready: list[EngineView]) -> None:
        """Executions queued on an engine move to engines that queue nothing and have room (KV below
        kv_fill after the move, a slot under the admission limit), largest context first."""
        q, fill = self.queue, self.config.kv_fill
        room = {e.id: fill * e.kv_capacity - e.kv_used for e in ready if not e.n_queued and q.room(e) > 0}
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
            if q.room(by_id[tid]) <= 1:
                del room[tid]
            q.move(x, by_id[tid])
            if not room:
                return

    def _consolidate(self, ready: list[EngineView]) -> None:
        """Drain the engines below load_share of their peak (the thinnest first) whose executions all fit elsewhere
        and can all move before they would finish (policies.elastic_plan.frees_sooner)."""
        c = self.config
        thin = {e.id for e in ready if e.n_live < c.load_share * self.peak.get(e.id, 0)}
        if not thin or len(ready) < 2:
            return
        live = self.cluster.live()
        finish, waits = self._predict(self._history())
        thin = {i for i in thin if frees_sooner([x for x in live if x.engine_id == i], finish, waits, self.cluster.now)}
        if not thin:
            return
        for k in range(len(thin), 0, -1):
            plan = plan_drain(ready, live, k, kv_fill=c.kv_fill, slots=self.queue.room)
            if not plan.parks and all(e.id in thin for e in plan.victims):
                self.draining = self.cluster.spawn(self._drain(plan, "consolidate"), "elastic-consolidate")
                return
