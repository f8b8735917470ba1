"""Elastic: a controller that moves GPUs between rollout and training, from a model of what each costs.

Generation never stops and admission is async's (policies.common.train_loop: the Batcher keeps
staleness <= eta). The controller observes the engines' load, the live executions' progress, what
finished executions showed (their segments, seconds per segment and durations: policies.elastic_history) and
the cluster's cost estimate (gyre.estimate: a training step's seconds on g GPUs, an engine's decode
throughput at n sequences, KV capacity, engine size, the trainer's memory minimum). It never sees a
future length. Then at each decision point it does one thing:

0. The start (policies.elastic_start, which says why). Every GPU starts an engine; before anything is
   admitted all but the fixed split the estimate balances stop (`initial_engines`; every engine at eta 0),
   and the GPUs left are kept for the first step's trainer. At a wake-up with no batch ready and no drain
   in flight (once the instant's events are in), once some execution has reached a tool call, they are
   lent if the first batch is predicted ready (as in 2.) later than lending costs (the engines' start, a
   migrant's wait for its boundary, an engine's stop, the trainer's load): engines start on all of them
   and the live executions spread evenly onto them at their next tool-call boundaries (`spread_moves`).
   A single-turn workload never shows a tool call and keeps the split through its first step.
1. A batch is ready (the first one too). For each trainer size the free GPUs plus the first k engines of the drain order
   allow (fewest live executions first; at least one engine stays; at least the memory minimum), up to the first
   whose migrants do not all fit on the staying engines (KV below `kv_fill` of capacity, a slot under the
   admission limit and `max_running`, the concurrency the search finds deadlines met at): a parked execution's
   deadline clock runs with nothing decoding, its batch waiting for a slot the slowest staying ones free; predict
   - when the step ends: the slowest migrant's wait for its tool-call boundary (a decoding execution is
     `boundary_share` of a segment from one, or its finish if its segment is expected to be its last;
     others move at once), then the batch's training time from the estimate;
   - when each live execution finishes: its remaining time drawn at its own fixed quantile level from its
     conditional spread (policies.elastic_history: remaining segments from the Kaplan-Meier segment
     distribution at its own seconds per segment; before it has finished one, its duration from the
     Kaplan-Meier durations given its age, times its engine's step time at its load over theirs), so a
     batch is predicted ready at its last finish, not at its executions' mean; stretched by the
     estimate's step time of the engine it ends up on over that of its engine now;
   - so when each later batch of the groups admitted so far is ready (the groups the staleness bound
     makes due first, then in order of predicted finish; queued executions take finished durations in
     start order), and when the last of them is trained (each batch as long as this one, once it is ready and
     the trainer free);
   - how many more executions its delays are expected to push past their deadline (each execution's
     budget is observed; the probability from the Kaplan-Meier segment distribution);
   and, among the sizes expected to cut at most `cut_share` of a step's executions more than the
   least-cutting one (a cut is lost work, never a speed-up), train on the one that trains that last
   group soonest (ties: the sooner step end, then the larger trainer); the drained engines restart for the
   rollout after the step, so each later batch a candidate trains on its GPUs pays its switch again (the
   migrants' wait and the engines' stop). Its engines are drained: executions
   migrate at their next tool-call boundary, never aborted.
   Where no size that reaches the trainer's minimum fits (where the minimum is most of the cluster), the
   smallest that does is drained now, parking the migrants that fit nowhere until the drained engines serve
   again after the step, if the next batch is so predicted to train sooner than by holding and the parks'
   delay to cut at most `cut_share` of a step's executions more (policies.elastic_plan.park_pays); else
   admission holds (nothing new starts; with `hold` off it goes on) until enough live executions finish for its
   migrants to fit.
2. A step ends. The number of engines to start on the freed GPUs is predicted the same way
   (policies.elastic_plan.choose_grow): the executions waiting to start (and the groups the staleness
   bound lets in next) take engine slots as they free, each taking what finished executions took,
   scaled by the estimate's step time at the load that many engines carry; the GPUs left free train the
   next steps (at eta 0, where every engine is empty when the next batch is ready, or every GPU but one
   engine's after the engines' stop, whichever is sooner); the count whose last pending group is trained
   soonest wins (ties: fewer). With no engine
   ready, every freed GPU starts one; at eta 0 and for single-turn rollouts the GPUs left free are the
   trainer's (not lent, 3.). Engines serving old weights sync; the started ones join the pool
   once they serve, and the next step does not wait for them. While they start, a ready engine is handed
   at most an even share of the work over the ready and starting engines (policies.elastic_pool).
3. An execution finishes or the pool changes, with no batch ready (and 0. lends nothing). Free GPUs beyond
   those kept for the trainer (the start's split until lent, then what 2. leaves where it keeps them) start
   engines if executions wait for room, and executions queued on one engine move to engines with room. An engine whose live
   executions have fallen below `load_share` of the most it held, while nothing waits for room, is
   drained if every one of its executions fits elsewhere and the drain frees it sooner than their
   finishes would (a single-turn rollout reaches no boundary: draining it frees nothing sooner and would
   hold up the next decision; all such engines at once): the tail is consolidated and its GPUs wait free
   for the next step. Where no group beyond the next batch's can run before that batch trains (at eta 0
   always, at any eta in the last step) only engines left empty stop early: every live execution is in
   the batch the trainer waits for and a freed GPU has nothing to train before it is ready, while a moved
   execution decodes in a larger batch on its new engine and so slows that batch's tail.

Per-engine concurrency, at every admission: an engine is handed no more executions than the most at
which each of its live executions is still predicted to meet its deadline (policies.elastic_pool.
DeadlineCaps: its predicted remaining time at the engine's load now, expected or at `protect_level` of its
remaining segments, scaled by the estimate's step time at n; one that misses even alone sets no cap),
within its admission limit and `max_running` (fixed, chosen by the equal-work search as async's: `grid`),
and with `tiers` within the tier of its oldest execution (policies.elastic_tiers, which says why: the
concurrency falls with age, as the long tail needs). A drain's migrants are placed within the limit,
`max_running` and the tiers, not the deadline caps. With `tiers`, at every wake-up with no drain in flight
(3.) an execution on an engine holding more than its tier allows moves, at its next tool-call boundary, to
an engine within its tier and every resident's (the least-tier engines first, then the fullest).

Every threshold is an `ElasticConfig` field with its reason. Simplifications: one drain at a time;
GPUs are taken in engine-sized pieces; a step's GPU count is fixed for the step.

Over 350 lines: the controller's state and one method per decision point, read beside the rule above; every
pure decision is in policies.elastic_plan, elastic_predict, elastic_start, elastic_pool and elastic_tiers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gyre.cluster import Cluster, ClusterError, EngineView, ExecutionView
from gyre.estimate import batch_counts
from gyre.handles import Handle, any_of
from gyre.policies.admission import OrderedAdmission
from gyre.policies.common import Batcher, ClusterShape, train_loop
from gyre.policies.elastic_config import ElasticConfig
from gyre.policies.elastic_history import History, Records, drawn_remaining_s
from gyre.policies.elastic_plan import Candidate, choose, choose_grow, evaluate, park_pays, plan_drain
from gyre.policies.elastic_predict import boundary_wait_s, cut_p, live_ends, load_scale, remaining_s
from gyre.policies.elastic_pool import DeadlineCaps, EnginePool
from gyre.policies.elastic_start import first_ready_at, initial_engines, lend, release_reserve, tool_call_seen
from gyre.policies.tuning import halvings


class Elastic:
    name = "elastic"
    Config = ElasticConfig

    def __init__(self, config: ElasticConfig | None = None, **params) -> None:
        self.config = config if config is not None else ElasticConfig(**params)
        self.eta = self.config.eta
        self.records = Records()

    def state(self) -> dict:
        """What a resumed real run continues (docs/writing-a-policy.md): the finished executions' records."""
        return self.records.state()

    def load_state(self, state: dict) -> None:
        self.records.load_state(state)

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        """Every eta, at every per-engine cap `max_running` async's search tries too (the admission limit,
        omitted, and its halvings: policies.tuning.halvings), all in one batch: equal work is judged against
        the least-cutting run at each eta, which may be the lowest cap."""
        fits = shape.n_gpus >= shape.min_train_gpus + shape.gpus_per_engine
        caps = halvings(shape.admit_limit)[1:] if shape.admit_limit else []
        return [p for e in etas for p in [{"eta": e}] + [{"eta": e, "max_running": c} for c in caps]] if fits else []

    # ------------------------------------------------------------------ the control loop
    def run(self, cluster: Cluster, steps: int):
        per, need, n = cluster.gpus_per_engine, cluster.min_train_gpus, cluster.n_gpus
        if n < need + per:  # the trainer and one engine must fit side by side
            raise ClusterError(f"elastic: needs >= {need + per} GPUs (a trainer of {need} beside an engine of {per}), "
                               f"the cluster has {n}")
        self.cluster = cluster
        self.est = cluster.estimate
        self.steps = steps
        self.records = Records()
        self.pool = EnginePool(cluster, kv_fill=self.config.kv_fill, load_share=self.config.load_share,
                               max_running=self.config.max_running, move_to_consolidate=self._beyond_next_batch,
                               tiers=self.config.tiers)
        self.pool.cap = DeadlineCaps(cluster, self.config, self._history, self._loads)
        self.gathering = False  # a batch's GPUs are being gathered
        order = OrderedAdmission(cluster, steps, self.config)
        self.batcher = batcher = Batcher(cluster, steps, self.eta, order, on_finish=self._finished)
        yield from self.pool.grow(sync=False)  # every GPU starts an engine; the split's surplus stops at once
        limit = max((e.admit_limit for e in self.pool.ready()), default=1)
        # an engine at its admission limit: its contexts fit its KV at their largest and about double over
        # their lives, so on average they fill `kv_fill` of it
        ctx = self.config.kv_fill * self.est.kv_capacity
        split = initial_engines(n_gpus=n, per=per, min_train=need, eta=self.eta, limit=limit, ctx=ctx,
                                step_s=self.est.step_s, train_s_per_token_gpu=self.est.train_s_per_token_gpu)
        stopped = self.pool.keep(split)
        self.pool.reserve = len(cluster.free_gpus()) + stopped  # the first step's trainer until lent (0.)
        self.start_reserve = self.pool.reserve > 0
        yield from train_loop(cluster, steps, batcher, self.pool.queue, engines=self.pool.ready, gather=self._gather,
                              after_step=self._after_step, wait=self._react, label="elastic-producer")
        order.report()

    def _finished(self, group, h: Handle) -> None:
        """An execution finished: sample the engines' load and record what it showed."""
        ready = [e for e in self.pool.engines if e.ready and e.n_live]
        if ready:
            self.records.sample_step(sum(self.est.step_s(e.n_live, e.kv_used) for e in ready) / len(ready))
        self.pool.load.fire()
        if h.error is None:
            self.records.finished(h.value, len(group.executions), self.cluster.now)

    def _history(self) -> History:
        return self.records.history(self.cluster.live())

    # ------------------------------------------------------------------ 1. a batch is ready
    def _gather(self, batch):
        """The step's GPUs: the candidate size the rule picks (module docstring, 1), its engines drained."""
        cluster, pool = self.cluster, self.pool
        self.gathering = True  # the GPUs being freed are the trainer's: no engine starts on them
        held = False
        while True:
            while not pool.idle:
                yield pool.draining
            best = self._choose(batch)
            if best is not None:
                break
            if pool.hold and not held:  # admission held until the live executions fit (1.)
                cluster.note("elastic_hold", live=len(cluster.live()))
            held = pool.hold
            # engines restarting after a fault: no trainer fits until one is back, which takes at least an
            # engine start (and any engine at least a step)
            yield any_of([pool.load.wait(), cluster.timeout(self.est.engine_start_s or self.est.step_s(1, 0))])
        cluster.note("elastic_train", gpus=best.gpus, engines=len(pool.engines) - len(best.plan.victims),
                     step_end=round(best.step_end, 3), next_ready=round(best.next_ready, 3))
        if best.plan.victims:
            yield from pool.drain(best.plan, "train")
        self.gathering = False
        return cluster.free_gpus()

    def _predict(self, hist: History, only: Sequence[ExecutionView] | None = None):
        """Each live execution's (or each of `only`'s) predicted finish (absolute: its remaining time drawn at
        its quantile level, policies.elastic_history) and wait for its next tool-call boundary."""
        c, now = self.config, self.cluster.now
        finish, waits = {}, {}
        load = self._loads()
        live = self.cluster.live()
        spread = self.records.spread(live, now, c.unseen_residual)  # over every live execution's age
        for x in live if only is None else only:
            f = load.get(x.engine_id, 1.0)
            rem = drawn_remaining_s(x, hist, spread, now, c.unseen_residual, f)
            if rem is None:
                rem = remaining_s(x, hist, now, c.unseen_residual, f)
            finish[x.id] = now + rem
            waits[x.id] = boundary_wait_s(x, hist, now, rem, c.boundary_share, c.unseen_residual, f)
        return finish, waits

    def _loads(self) -> dict[int, float]:
        """Each ready engine's step time now (the estimate's, at its load) over the mean one the finished
        executions were measured at (policies.elastic_plan.seg_s)."""
        seen = self.records.seen
        if seen <= 0:
            return {}
        return {e.id: self.est.step_s(e.n_live, e.kv_used) / seen for e in self.pool.engines if e.ready and e.n_live}

    def _pending(self, exclude: set[int] = frozenset()) -> tuple[list[int], list[int], list[int]]:
        """The untrained groups (ids; those still to be admitted, up to what the staleness bound lets in
        next, get ids below 0), the group id of each execution waiting to start, in order, and each pending
        group's batch index among the coming ones by the staleness bound (admitted at version a: due at
        step a + eta; one still to be admitted joins at the next version)."""
        b = self.batcher
        pending = [g.id for _, g in b.admitted if g.id not in exclude]
        due = [max(0, a + self.eta - b.step) for a, g in b.admitted if g.id not in exclude]
        queued = [x.group_id for x, _ in self.pool.queue.waiting]
        new = self._admissible()
        for i in range(new):
            pending.append(-1 - i)
            due.append(self.eta)
            queued += [-1 - i] * self.records.group_size
        return pending, queued, due

    def _admissible(self) -> int:  # groups the staleness bound lets in before the next step, of those still to come
        b = self.batcher
        return max(0, min(b.steps * b.gps - b.n_admitted, (self.eta + 1) * b.gps - len(b.admitted)))

    def _beyond_next_batch(self) -> bool:
        """More untrained groups admitted or admissible than the next batch takes (3.)?"""
        return len(self.batcher.admitted) + self._admissible() > self.batcher.gps

    def _choose(self, batch) -> Candidate | None:
        cluster, est, c, rec = self.cluster, self.est, self.config, self.records
        now, hist, live = cluster.now, self._history(), cluster.live()
        finish, waits = self._predict(hist)
        rec.max_ctx = max([rec.max_ctx] + [x.context_tokens for x in live])
        tokens, attn = rec.last_counts = batch_counts((x for g in batch for x in g.executions), rec.max_ctx or math.inf)
        pending, queued, due = self._pending(exclude={g.id for g in batch})
        ready, free = self.pool.ready(), len(cluster.free_gpus())
        scale = load_scale(self.est.step_s, ready, len(queued), hist.ctx, self.records.seen)
        load, group_of = self._loads(), {x.id: x.group_id for x in live}
        limit = max((e.admit_limit for e in ready), default=1)
        starting = [now + est.engine_start_s] * (self.pool.starting * limit)  # engines started after the last step
        durations = rec.durations()
        risk = lambda x, s: cut_p(x, hist, now, c.unseen_residual, s, load.get(x.engine_id, 1.0))  # noqa: E731
        cands, blocked, self.pool.hold = [], None, False
        for k in range(len(ready)):
            plan = plan_drain(ready, live, k, kv_fill=c.kv_fill, slots=self.pool.drain_room)
            if len(plan.victims) < k or plan.parks:
                blocked = k if plan.parks and not cands else None  # the first drain whose migrants do not fit
                break  # the sizes beyond drain these engines and more, onto fewer
            g = free + len(plan.gpus)
            if g < cluster.min_train_gpus:
                continue
            train = est.train_s(tokens, attn, g) + (est.trainer_start_s if plan.victims else 0.0)
            cands.append(evaluate(plan, gpus=g, now=now, train_s=train, finish=finish,
                                  waits_s=waits, engines=ready, live=live, group_of=group_of, pending=pending,
                                  finished=set(self.batcher.finished), n_next=self.batcher.gps, queued=queued,
                                  durations=durations, step_s=est.step_s, stop_s=est.engine_stop_s,
                                  start_s=est.engine_start_s, risk=risk, scale=scale, due=due, starting=starting))
        tol = c.cut_share * self.batcher.gps * rec.group_size
        if blocked is not None:  # nothing fits: park the smallest size's overflow, or hold (1.)
            for k in range(blocked, len(ready)):
                plan = plan_drain(ready, live, k, kv_fill=c.kv_fill, slots=self.pool.drain_room)
                if free + len(plan.gpus) >= cluster.min_train_gpus:
                    break
            g = free + len(plan.gpus)
            train = est.train_s(tokens, attn, g) + est.trainer_start_s
            gather = max([waits[x.id] for x, _ in plan.moves] + [waits[x.id] for x in plan.parks], default=0.0)
            extra = lambda d: sum(cut_p(x, hist, now, c.unseen_residual, 1.0, load.get(x.engine_id, 1.0), d)  # noqa: E731
                                  - risk(x, 1.0) for x in plan.parks)
            if g >= cluster.min_train_gpus and park_pays(
                    now=now, finish=finish, group_of=group_of, pending=pending, finished=set(self.batcher.finished),
                    due=due, per_batch=self.batcher.gps, parks=[x.id for x in plan.parks],
                    capacity=sum(self.pool.most(e) for e in ready if e not in plan.victims),
                    gather_s=gather, stop_s=est.engine_stop_s, train_s=train, start_s=est.engine_start_s,
                    extra_cuts=extra, tolerance=tol):
                end = now + gather + est.engine_stop_s + train
                return Candidate(gpus=g, plan=plan, step_end=end, next_ready=end, last_end=end, train_s=train)
            self.pool.hold = c.hold
        return choose(cands, tol) if cands else None

    # ------------------------------------------------------------------ 2. a step ends
    def _after_step(self):
        self.pool.reserve = 0
        self.start_reserve = False
        if self.cluster.version < self.steps:
            k = self._engines_to_start()
            # the GPUs choose_grow leaves free are the trainer's at eta 0 and for single-turn rollouts (2.: its
            # prediction covers the whole next batch, or a drain would not return them before they finish)
            segs = self.records.segs
            keep = self.eta == 0 or (bool(segs) and max(segs) <= 1)
            self.pool.reserve = len(self.cluster.free_gpus()) - k * self.cluster.gpus_per_engine if keep else 0
            self.pool.start(k)  # the next step need not wait for them
            yield from self.pool.grow(sync=True, engines=0)

    def _engines_to_start(self) -> int:
        """How many engines to start on the free GPUs (policies.elastic_plan.choose_grow)."""
        cluster, est, b = self.cluster, self.est, self.batcher
        ready = self.pool.ready()
        per, free = cluster.gpus_per_engine, len(cluster.free_gpus())
        if not ready:
            return free // per
        hist, now = self._history(), cluster.now
        finish, _ = self._predict(hist)
        ends = live_ends(self.cluster.live(), finish, now)
        pending, queued, due = self._pending()
        tokens, attn = self.records.last_counts
        last = hist.segments[-1] if hist.segments else 1
        drain = hist.seg_s * (1 if last <= 1 else self.config.boundary_share)
        limit = max(e.admit_limit for e in ready)
        scale = load_scale(self.est.step_s, ready, len(queued), hist.ctx, self.records.seen)
        return choose_grow(now=now, free_gpus=free, per=per, min_train=cluster.min_train_gpus, engines=len(ready),
                           limit=limit, live_free_at=list(finish.values()),
                           unused_slots=sum(max(0, e.admit_limit - e.n_live) for e in ready), live_ends=ends,
                           pending=pending, finished=set(b.finished), queued=queued, durations=self.records.durations(),
                           scale=scale, per_batch=b.gps, train_s=lambda g: est.train_s(tokens, attn, g) + est.trainer_start_s,
                           start_s=est.engine_start_s, drain_s=drain + est.engine_stop_s, due=due,
                           empty_drain_s=est.engine_stop_s if self.eta == 0 else None)

    # ------------------------------------------------------------------ 3. between decisions
    def _react(self) -> list[Handle]:
        """Between decisions: lend the start's trainer GPUs where that pays (0.), else EnginePool.between_decisions
        (lend, rebalance, consolidate). Returns the handles the loop also wakes on."""
        pool = self.pool
        if not self.gathering:
            pool.sort_by_age()
            batch_waiting = self.batcher.next_batch() is not None
            seen = self.start_reserve and tool_call_seen([x.turns_done for x in self.cluster.live()], self.records.segs)
            if seen and pool.idle and not batch_waiting:
                pool.draining = self.cluster.spawn(self._release(), "elastic-release")
            else:
                pool.between_decisions(batch_waiting, lambda xs: self._predict(self._history(), xs))
        return [pool.load.wait()]

    # ------------------------------------------------------------------ 0. the start's trainer GPUs
    def _release_pays(self) -> bool:
        """policies.elastic_start.release_reserve on what is observed now: the first batch's predicted
        readiness (`first_ready_at`; with none finished, queued executions take what the live ones are
        predicted to take in all), a drain's wait (`boundary_share` of the finished ones' mean segment)."""
        est, now, live = self.est, self.cluster.now, self.cluster.live()
        hist = self._history()
        finish, _ = self._predict(hist)
        pending, queued, due = self._pending()
        durations = self.records.durations() or [finish[x.id] - x.started_at for x in live if x.started_at is not None]
        ready = first_ready_at(now=now, live_ends=live_ends(live, finish, now), live_free_at=list(finish.values()),
                               unused_slots=sum(max(0, e.admit_limit - e.n_live) for e in self.pool.ready()),
                               queued=queued, durations=durations, pending=pending,
                               finished=set(self.batcher.finished), per_batch=self.batcher.gps, due=due)
        return release_reserve(tool_call=True, ready_in_s=ready - now, wait_s=self.config.boundary_share * hist.seg_s,
                               start_s=est.engine_start_s, stop_s=est.engine_stop_s, onload_s=est.trainer_start_s)

    def _release(self):
        """Once this instant's events are in (executions finishing together), lend the start's trainer GPUs
        if that pays (policies.elastic_start.lend); if it does not, nothing changes."""
        pool = self.pool
        yield self.cluster.timeout(0.0)
        if self.batcher.next_batch() is None and self._release_pays():
            self.start_reserve = False
            yield from lend(self.cluster, pool, self.config.kv_fill)
            pool.load.fire()
        pool.draining = None
