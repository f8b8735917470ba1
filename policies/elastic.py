"""Elastic: GPUs move between rollout and training, sized by forecasts of when the pending groups are trained.

Generation never stops; the Batcher keeps staleness <= eta. The controller sees engine load, the live executions'
progress, finished executions, the cost estimate and the share of its exact work the last step trained
(`trained_share`); never a future length. Every decision forecasts, from one snapshot (elastic_forecast.Forecast),
when the last pending group is trained, among choices expected to cut at most the equal-work tolerance more executions
than the least-cutting one. Executions move only at tool-call boundaries; none is aborted.

0. Start: every GPU starts an engine; all but the split that balances decode and training stop, the rest is
   the reserve, kept free for the first trainer. Once a tool call has been seen and the first batch is
   predicted later than lending and returning the reserve costs, the reserve starts engines and the live
   executions spread evenly onto them.
1. A batch is ready: the trainer is the free GPUs plus those of the k emptiest engines, drained (their
   executions migrate to the staying engines, within kv_fill and max_running); the k whose last pending group
   is trained soonest wins. If no size fits its migrants, the smallest that reaches the trainer's minimum
   drains now and parks the overflow if the next batch so trains sooner; else admission holds until they fit.
2. A step ends: of the freed GPUs, start the number of engines whose last pending group is trained soonest;
   the rest stay the trainer's (the reserve at eta 0 and for single-turn rollouts).
3. Between decisions (nothing in flight, no batch ready): free GPUs beyond the reserve start engines for
   executions waiting for room, or executions queued for KV move to engines with room; else an engine below
   load_share of its peak is drained if that frees it sooner than its executions' finishes (at eta 0 and in
   the last step only engines left empty stop: every live execution is then in the batch the trainer waits for).
Every engine is handed at most the deadline cap (the most executions at which each live one there is still
predicted to meet its deadline), max_running, and while engines start an even part of the work.
Rationale, figures and glossary: docs/elastic.md.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gyre.cluster import Cluster, ClusterError
from gyre.estimate import batch_counts
from gyre.handles import Handle, any_of
from gyre.policies.common import Batcher, ClusterShape, train_loop
from gyre.policies.elastic_config import ElasticConfig
from gyre.policies.deadline_cap import DeadlineCaps
from gyre.policies.elastic_forecast import (Forecast, boundary_wait_s, cut_p, drawn_remaining_s, load_scale,
                                            remaining_s)
from gyre.policies.elastic_plan import Candidate, choose_grow, initial_engines, lend_pays, size_trainer, tool_call_seen
from gyre.policies.elastic_pool import EnginePool
from gyre.policies.lengths import History, Records
from gyre.policies.tuning import WORK_TOLERANCE, halvings


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
        """Every eta, uncapped and at each `max_running` async's search tries (the admission limit's halvings)."""
        fits = shape.n_gpus >= shape.min_train_gpus + shape.gpus_per_engine
        caps = halvings(shape.admit_limit)[1:] if shape.admit_limit else []
        return [p for e in etas for p in [{"eta": e}] + [{"eta": e, "max_running": c} for c in caps]] if fits else []

    def run(self, cluster: Cluster, steps: int):
        per, need, n, c = cluster.gpus_per_engine, cluster.min_train_gpus, cluster.n_gpus, self.config
        if n < need + per:
            raise ClusterError(f"elastic: needs >= {need + per} GPUs (a trainer of {need} beside an engine of {per}), "
                               f"the cluster has {n}")
        self.cluster, self.est, self.steps, self.records = cluster, cluster.estimate, steps, Records()
        caps = DeadlineCaps(cluster, self._remaining, self._loads)
        self.pool = pool = EnginePool(cluster, kv_fill=c.kv_fill, load_share=c.load_share, max_running=c.max_running,
                                      cap=caps, move_to_consolidate=self._beyond_next_batch)
        self.gathering = False  # a batch's GPUs are being gathered
        self.restart_s = self.est.engine_start_s or self.est.step_s(1, 0)  # engines back after a fault fire no load
        self.batcher = Batcher(cluster, steps, self.eta, on_finish=self._finished)
        yield from pool.grow(sync=False)
        limit = max((e.admit_limit for e in pool.ready()), default=1)
        # an engine at its admission limit: its contexts about double over their lives, so fill kv_fill of its KV
        split = initial_engines(n_gpus=n, per=per, min_train=need, eta=self.eta, limit=limit,
                                ctx=c.kv_fill * self.est.kv_capacity, step_s=self.est.step_s,
                                train_s_per_token_gpu=self.est.train_s_per_token_gpu)
        stopped = pool.keep(split)
        pool.set_reserve(len(cluster.free_gpus()) + stopped)
        self.start_reserve = pool.reserve > 0  # the start's reserve, not yet lent
        yield from train_loop(cluster, steps, self.batcher, pool.admission, engines=pool.ready, gather=self._gather,
                              after_step=self._after_step, wait=self._react, label="elastic-producer")

    def _finished(self, group, h: Handle) -> None:  # sample the engines' load, record what it showed
        ready = [e for e in self.pool.engines if e.ready and e.n_live]
        if ready:
            self.records.sample_step(sum(self.est.step_s(e.n_live, e.kv_used) for e in ready) / len(ready))
        self.pool.load.fire()
        if h.error is None:
            self.records.finished(h.value, len(group.executions), self.cluster.now)

    def _history(self) -> History:
        return self.records.history(self.cluster.live())

    def _remaining(self):  # for the deadline cap: expected remaining seconds at an engine's load factor
        hist, now, r = self._history(), self.cluster.now, self.config.unseen_residual
        return lambda x, load: remaining_s(x, hist, now, r, load)

    def _loads(self) -> dict[int, float]:
        """Each busy engine's step time now over the mean one finished executions were measured at."""
        seen = self.records.seen
        if seen <= 0:
            return {}
        return {e.id: self.est.step_s(e.n_live, e.kv_used) / seen for e in self.pool.engines if e.ready and e.n_live}

    def _predict(self, hist: History, only=None) -> tuple[dict[int, float], dict[int, float]]:
        """Each live execution's (or `only`'s) predicted finish (drawn, else expected) and boundary wait."""
        c, now, load, live = self.config, self.cluster.now, self._loads(), self.cluster.live()
        dist = self.records.duration_dist(live, now, c.unseen_residual)
        finish, waits = {}, {}
        for x in live if only is None else only:
            f = load.get(x.engine_id, 1.0)
            rem = drawn_remaining_s(x, hist, dist, now, c.unseen_residual, f)
            if rem is None:
                rem = remaining_s(x, hist, now, c.unseen_residual, f)
            finish[x.id] = now + rem
            waits[x.id] = boundary_wait_s(x, hist, now, rem, c.boundary_share, c.unseen_residual, f)
        return finish, waits

    def _admissible(self) -> int:  # groups the staleness bound lets in before the next step, of those to come
        b = self.batcher
        return max(0, min(b.steps * b.gps - b.n_admitted, (self.eta + 1) * b.gps - len(b.admitted)))

    def _beyond_next_batch(self) -> bool:  # more untrained groups admitted or admissible than a batch takes (3.)
        return len(self.batcher.admitted) + self._admissible() > self.batcher.gps

    def _forecast(self, hist: History, exclude: set[int] = frozenset()) -> Forecast:
        """The snapshot every decision reads; a group admitted at version a is due at step a + eta."""
        cl, est, b, rec, r = self.cluster, self.est, self.batcher, self.records, self.config.unseen_residual
        now, live, ready, load = cl.now, cl.live(), self.pool.ready(), self._loads()
        finish, waits = self._predict(hist)
        pending = [g.id for _, g in b.admitted if g.id not in exclude]
        due = [max(0, a + self.eta - b.step) for a, g in b.admitted if g.id not in exclude]
        waiting = [x.group_id for x, _ in self.pool.admission.waiting]
        for i in range(self._admissible()):
            pending.append(-1 - i)
            due.append(self.eta)
            waiting += [-1 - i] * rec.group_size
        tokens, attn = rec.last_counts
        limit = max((e.admit_limit for e in ready), default=1)
        return Forecast(now=now, engines=tuple(ready), live=tuple(live), finish=finish, waits=waits,
                        pending=tuple(pending), due=tuple(due), finished=frozenset(b.finished), waiting=tuple(waiting),
                        durations=tuple(rec.durations()), per_batch=b.gps, free=len(cl.free_gpus()),
                        per=cl.gpus_per_engine, min_train=cl.min_train_gpus,
                        starting=(now + est.engine_start_s,) * (self.pool.starting * limit),
                        scale=load_scale(est.step_s, ready, len(waiting), hist.ctx, rec.seen), step_s=est.step_s,
                        train_s=lambda g: est.train_s(tokens, attn, g),
                        risk=lambda x, s=1.0, d=0.0: cut_p(x, hist, now, r, s, load.get(x.engine_id, 1.0), d),
                        start_s=est.engine_start_s, stop_s=est.engine_stop_s, onload_s=est.trainer_start_s)

    def _gather(self, batch):
        """The step's GPUs: the size `_choose` picks, its engines drained; admission held while none fits."""
        cluster, pool = self.cluster, self.pool
        self.gathering = True  # the GPUs being freed are the trainer's: no engine starts on them
        held = False
        while True:
            while not pool.idle:
                yield pool.in_flight()
            best, hold = self._choose(batch)
            pool.hold_admission(hold)
            if best is not None:
                break
            if hold and not held:
                cluster.note("elastic_hold", live=len(cluster.live()))
            held = hold
            yield any_of([pool.load.wait(), cluster.timeout(self.restart_s)])
        cluster.note("elastic_train", gpus=best.gpus, engines=len(pool.engines) - len(best.plan.victims),
                     step_end=round(best.step_end, 3), next_ready=round(best.next_ready, 3))
        if best.plan.victims:
            yield from pool.drain(best.plan, "train")
        self.gathering = False
        return cluster.free_gpus()

    def _choose(self, batch) -> tuple[Candidate | None, bool]:
        """elastic_plan.size_trainer on a forecast that excludes the batch; writes no pool state."""
        rec, live = self.records, self.cluster.live()
        rec.max_ctx = max([rec.max_ctx] + [x.context_tokens for x in live])
        rec.last_counts = batch_counts((x for g in batch for x in g.executions), rec.max_ctx or math.inf,
                                       self.cluster.trained_share)
        f = self._forecast(self._history(), exclude={g.id for g in batch})
        return size_trainer(f, kv_fill=self.config.kv_fill, slots=self.pool.drain_room, most=self.pool.most,
                            tolerance=WORK_TOLERANCE * self.batcher.gps * rec.group_size)

    def _after_step(self):
        self.pool.set_reserve(0)
        self.start_reserve = False
        if self.cluster.version < self.steps:
            k = self._engines_to_start()
            # free GPUs stay the trainer's at eta 0 and for single-turn rollouts (a drain returns none in time)
            keep = self.eta == 0 or max(self.records.segs, default=2) <= 1
            self.pool.set_reserve(len(self.cluster.free_gpus()) - k * self.cluster.gpus_per_engine if keep else 0)
            self.pool.start(k)  # the next step need not wait for them
            yield from self.pool.grow(sync=True, engines=0)

    def _engines_to_start(self) -> int:
        if not self.pool.ready():
            return len(self.cluster.free_gpus()) // self.cluster.gpus_per_engine
        hist = self._history()
        last = hist.segments[-1] if hist.segments else 1
        drain_s = hist.seg_s * (1 if last <= 1 else self.config.boundary_share) + self.est.engine_stop_s
        return choose_grow(self._forecast(hist), drain_s, self.est.engine_stop_s if self.eta == 0 else None)

    def _react(self) -> list[Handle]:
        """Lend the start's reserve where that pays (0.), else the pool's between-decision steps (3.)."""
        pool = self.pool
        if not self.gathering:
            batch_waiting = self.batcher.next_batch() is not None
            seen = self.start_reserve and tool_call_seen([x.turns_done for x in self.cluster.live()], self.records.segs)
            if seen and pool.idle and not batch_waiting:
                pool.lend_reserve(self._lend_now)
            else:
                pool.between_decisions(batch_waiting, lambda xs: self._predict(self._history(), xs))
        restarting = pool.engines and not pool.ready()  # after a fault: look again once an engine may be back
        return [pool.load.wait()] + ([self.cluster.timeout(self.restart_s)] if restarting else [])

    def _lend_now(self) -> bool:
        """Lend the reserve now? No batch ready and elastic_plan.lend_pays (with nothing finished, waiting
        executions take what the live ones are predicted to take in all)."""
        if self.batcher.next_batch() is not None:
            return False
        hist = self._history()
        f = self._forecast(hist)
        if not f.durations:
            f = replace(f, durations=tuple(f.finish[x.id] - x.started_at for x in f.live if x.started_at is not None))
        if not lend_pays(f, self.config.boundary_share * hist.seg_s):
            return False
        self.start_reserve = False
        return True
