"""The elastic controller's engines: starting them, draining them, and consolidating a thinning tail.

`EnginePool` holds the engines that accept admissions and carries out what the controller
(policies.elastic) decides: start engines on free GPUs (`grow`), empty engines by migration at tool-call
boundaries or parking and stop them (`drain`, one at a time), and between decisions lend free GPUs to
executions waiting for room (`lend`), move executions queued on a full engine to engines with room
(`rebalance`), and drain engines whose load has thinned below `load_share` of their peak (`consolidate`).
An engine is handed at most an even share of the work while engines start (`share`), and at most what the
controller's cap allows (`deadline_cap`: the most executions at which each of its live executions is still
predicted to meet its deadline).
No execution is ever aborted: a migrant moves at its next tool-call boundary; the controller drains only
engines whose executions all have room elsewhere, and one left on a drained engine all the same (moved back
by a fault's restart, or joined meanwhile) is parked (policies.admit_queue) and resumed where room frees.

Simplifications: one drain in flight at a time; engines are started and stopped whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView, Phase
from gyre.handles import Handle, all_of
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Signal, engine_slots
from gyre.policies.elastic_plan import DrainPlan, plan_drain
from gyre.policies.elastic_predict import frees_sooner, protected_remaining_s, remaining_s
from gyre.policies.elastic_tiers import TierCaps, sort_moves


class EnginePool:
    def __init__(self, cluster: Cluster, *, kv_fill: float, load_share: float, max_running: int | None = None,
                 move_to_consolidate: Callable[[], bool] = lambda: True,
                 tiers: Sequence[tuple[float, int]] | None = None) -> None:
        self.cluster = cluster
        # may a consolidation move live executions now (policies.elastic, 3.), or only stop engines with none left
        self.move_to_consolidate = move_to_consolidate
        self.kv_fill = kv_fill  # a target engine takes migrants up to this share of its KV (ElasticConfig)
        self.load_share = load_share  # below this share of its peak load an engine is consolidated (ElasticConfig)
        self.engines: list[EngineView] = []  # engines that accept admissions (starting or ready)
        self.peak: dict[int, int] = {}  # engine id -> the most live executions it held
        self.draining: Handle | None = None  # the one drain (or lend) in flight
        self.load = Signal()  # an execution finished, or the pool changed
        self.starting = 0  # engines started and not yet serving
        self.cap: Callable[[EngineView], int] | None = None  # the controller's own per-engine cap, if any
        self.tiers = tiers  # placement by age (ElasticConfig.tiers; policies.elastic_tiers), if any
        self.tier_cap = TierCaps(cluster, tiers) if tiers else None
        self.reserve = 0  # free GPUs kept for the trainer: never lent to executions waiting for room
        self.max_running = max_running  # executions an engine is handed at most (ElasticConfig); None: its limit
        self.hold = False  # a ready batch has no trainer size whose migrants fit: hand nothing (policies.elastic, 1.)
        self.queue = AdmissionQueue(cluster, self.ready, limit=self.limit)
        self.moving: dict[int, tuple[Handle, int]] = {}  # execution id -> its move in flight and its target

    def move(self, x: ExecutionView, target: EngineView) -> Handle:
        """Migrate `x` to `target` at its next tool-call boundary; one already moving keeps its move (the
        handle returned is that one's)."""
        if x.id in self.moving:
            return self.moving[x.id][0]
        h = self.queue.move(x, target)
        self.moving[x.id] = (h, target.id)
        h.on_done(lambda _h, i=x.id: self.moving.pop(i, None))
        return h

    def park(self, x: ExecutionView) -> Handle:
        """Park `x` at its next tool-call boundary (one moving: its move's handle; the caller looks again)."""
        return self.moving[x.id][0] if x.id in self.moving else self.queue.park(x)

    def sort_by_age(self) -> None:
        """With no drain in flight, move each execution over its tier to an engine within it (policies.
        elastic_tiers.sort_moves), at its next tool-call boundary."""
        if self.tiers and self.idle:
            for x, t in sort_moves(self.ready(), self.cluster.live(), self.cluster.now, self.tiers,
                                   kv_fill=self.kv_fill, incoming=self.queue.incoming, moving=set(self.moving)):
                self.move(x, t)

    def moves_into(self, ids: set[int]) -> list[Handle]:
        """The moves in flight to the engines `ids` (a drain waits for them before it stops those engines)."""
        return [h for h, t in self.moving.values() if t in ids]

    def drain_room(self, e: EngineView) -> int:
        """Migrants `e` may still take in a drain: within its admission limit and `max_running`, not the
        deadline caps (policies.elastic, Per-engine concurrency)."""
        return self.most(e) - e.n_live - self.queue.incoming.get(e.id, 0)

    def most(self, e: EngineView) -> int:
        """The executions `e` may hold after a drain: its admission limit, `max_running` and its tier."""
        most = e.admit_limit if self.max_running is None else min(e.admit_limit, self.max_running)
        # within the tier of its oldest execution (policies.elastic_tiers)
        return most if self.tier_cap is None else min(most, self.tier_cap(e))

    def limit(self, e: EngineView) -> int:
        """The executions `e` may be handed: none while `hold`, else its even `share` while engines start,
        within `max_running` and the controller's `cap`."""
        if self.hold:
            return 0
        n = self.share(e) if self.max_running is None else min(self.share(e), self.max_running)
        n = n if self.tier_cap is None else min(n, self.tier_cap(e))
        return n if self.cap is None else min(n, self.cap(e))

    def share(self, e: EngineView) -> int:
        """While engines are starting, a ready engine is handed no more than an even share of the work
        (live and waiting executions) over the ready and starting engines: an execution waits the start
        (seconds) rather than crowd an engine whose every step it would slow for its whole life (a decoding
        sequence gains one token per step, and a step's time grows with the sequences it runs)."""
        if not self.starting:
            return e.admit_limit
        ready = self.ready()
        work = sum(x.n_live for x in ready) + len(self.queue)
        return max(1, -(-work // (len(ready) + self.starting)))

    def ready(self) -> list[EngineView]:
        """The engines executions may be admitted to."""
        return [e for e in self.engines if e.ready]

    @property
    def idle(self) -> bool:
        """No drain in flight."""
        return self.draining is None or self.draining.done

    def waiting_for_room(self) -> bool:
        """Executions wait for room: unstarted or parked in the admission queue, or queued on an engine."""
        return len(self.queue) > 0 or any(e.n_queued for e in self.ready())

    def grow(self, sync: bool = True, engines: int | None = None):
        """Start `engines` engines (None: as many as the free GPUs hold) on the free GPUs and sync stale
        engines; yields until all serve."""
        cluster = self.cluster
        stale = [e for e in self.engines if e.ready and e.version < cluster.version] if sync else []
        waits = self._start(engines)
        n = len(waits)
        if stale:
            waits.append(cluster.sync(stale))
        if not waits:
            return
        done = yield all_of(waits)
        self._joined(done[:n])

    def keep(self, engines: int) -> int:
        """Stop all but the first `engines` of the ready engines that hold no execution (the split's surplus,
        before anything is admitted), without waiting for them (admission need not wait for their sleep).
        Returns the GPUs they free."""
        ready = self.ready()
        surplus = [e for e in ready if not e.n_live and not e.n_queued][: max(0, len(ready) - engines)]
        if surplus:
            ids = {e.id for e in surplus}
            self.engines = [e for e in self.engines if e.id not in ids]
            self.cluster.note("elastic_split", engines=len(self.engines), stopped=len(surplus))
            for e in surplus:
                self.cluster.stop_engine(e)
        return sum(len(e.gpus) for e in surplus)

    def start(self, engines: int) -> None:
        """Start `engines` engines on the free GPUs now, without waiting for them: they join the pool once
        they serve (the trainer need not wait for engines its GPUs do not hold)."""
        waits = self._start(engines)
        if waits:
            self.starting += len(waits)

            def joined(h: Handle) -> None:
                self.starting -= len(waits)
                self._joined(h.value if h.error is None else [])

            all_of(waits).on_done(joined)

    def _start(self, engines: int | None) -> list[Handle]:
        cluster = self.cluster
        slots = engine_slots(sorted(cluster.free_gpus()), cluster.gpus_per_engine)
        slots = slots if engines is None else slots[:engines]
        if slots:
            cluster.note("elastic_grow", engines=len(slots))
        return [cluster.start_engine(s) for s in slots]

    def _joined(self, engines: Sequence[EngineView]) -> None:
        self.engines.extend(engines)
        self.queue.pump()
        self.load.fire()

    def drain(self, plan: DrainPlan, why: str):
        """Empty the plan's engines (moves, parks), then stop them. An execution still on one once its move
        is done (it was moved back by a fault's restart, or joined meanwhile) is parked."""
        cluster = self.cluster
        ids = {e.id for e in plan.victims}
        self.engines = [e for e in self.engines if e.id not in ids]
        cluster.note("elastic_drain", why=why, engines=sorted(ids), moves=len(plan.moves), parks=len(plan.parks))
        yield all_of([self.move(x, t) for x, t in plan.moves] + [self.park(x) for x in plan.parks]
                     + self.moves_into(ids))
        left = [x for x in cluster.live() if x.engine_id in ids]
        while left:
            yield all_of([self.park(x) for x in left] + self.moves_into(ids))
            left = [x for x in cluster.live() if x.engine_id in ids]
        yield all_of([cluster.stop_engine(e) for e in plan.victims])
        self.draining = None  # done: whoever wakes on the pool's change may start the next drain
        self.load.fire()

    def between_decisions(self, batch_waiting: bool, predict: Callable[[Sequence[ExecutionView]], tuple[dict, dict]]
                          ) -> None:
        """With no batch ready and no drain in flight: lend free GPUs or rebalance queues where executions
        wait for room, else consolidate a thinning engine (`predict(xs)`: the predicted finish and wait for
        the next tool-call boundary of the live executions xs)."""
        ready = self.ready()
        for e in ready:
            self.peak[e.id] = max(self.peak.get(e.id, 0), e.n_live)
        if not self.idle or len(ready) != len(self.engines) or batch_waiting:
            return
        if self.waiting_for_room():
            lendable = (len(self.cluster.free_gpus()) - self.reserve) // self.cluster.gpus_per_engine
            if lendable > 0:
                self.draining = self.cluster.spawn(self._lend(lendable), "elastic-grow")
            else:
                self.rebalance(ready)
        else:
            self.consolidate(ready, predict)

    def _lend(self, engines: int):
        yield from self.grow(sync=False, engines=engines)
        self.rebalance(self.ready())
        self.draining = None
        self.load.fire()

    def rebalance(self, ready: list[EngineView]) -> None:
        """Executions queued on an engine move to engines that queue nothing and have room (KV below
        kv_fill after the move, a slot under the admission limit), largest context first."""
        q, fill = self.queue, self.kv_fill
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
            self.move(x, by_id[tid])
            if not room:
                return

    def consolidate(self, ready: Sequence[EngineView], predict: Callable[[Sequence[ExecutionView]], tuple[dict, dict]]
                    ) -> None:
        """Drain the engines below load_share of their peak (the thinnest first) whose executions all fit
        elsewhere and can all move before they would finish (policies.elastic_plan.frees_sooner); without
        `move_to_consolidate()`, only engines that hold no live execution. `predict(xs)`: the predicted finish
        and boundary wait of the live executions `xs` (those on the thin engines)."""
        move = self.move_to_consolidate()
        thin = {e.id for e in ready if e.n_live < self.load_share * self.peak.get(e.id, 0) and (move or not e.n_live)
                and not self.queue.incoming.get(e.id)}  # one with a move on its way is a target, not thin
        if not thin or len(ready) < 2:
            return
        live = self.cluster.live()
        on: dict[int, list[ExecutionView]] = {}  # thin engine -> its live executions
        for x in live:
            if x.engine_id in thin:
                on.setdefault(x.engine_id, []).append(x)
        if on:  # an empty engine frees at once
            finish, waits = predict([x for xs in on.values() for x in xs])
            now = self.cluster.now
            thin = {i for i in thin if i not in on or frees_sooner(on[i], finish, waits, now)}
        if not thin:
            return
        for k in range(len(thin), 0, -1):
            plan = plan_drain(ready, live, k, kv_fill=self.kv_fill, slots=self.drain_room)
            if not plan.parks and all(e.id in thin for e in plan.victims):
                self.draining = self.cluster.spawn(self.drain(plan, "consolidate"), "elastic-consolidate")
                return


def deadline_cap(remaining: Sequence[tuple[float, float]], now: float, step_s: Callable[[int], float],
                 n_now: int, limit: int) -> int:
    """The most executions an engine may hold so that every one of its live executions still meets its
    deadline: `remaining` holds each one's (predicted remaining seconds at the engine's load now, n_now
    sequences; its deadline), and at n sequences that time scales by step_s(n) / step_s(n_now) (a
    decoding sequence gains one token per step). One that misses its deadline even alone on the engine
    is past help and sets no cap. Returns the largest n in [1, limit] that keeps the rest (limit if none
    is at risk); step_s is non-decreasing in n, so the answer is found by bisection."""
    base = step_s(max(n_now, 1))
    if base <= 0:
        return limit
    alone = step_s(1) / base
    slack = [(deadline - now) / rem for rem, deadline in remaining
             if rem > 0 and deadline < float("inf") and now + rem * alone <= deadline]
    if not slack:
        return limit
    most = min(slack) * base  # the longest step time every one of them can afford
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid) <= most:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DeadlineCaps:
    """Per-engine concurrency (policies.elastic's docstring), the pool's `cap`: the most executions an engine
    may hold with each of its live executions still predicted to meet its deadline (`deadline_cap`), from
    its predicted remaining time at the engine's load now (expected, or at `protect_level` of its conditional
    remaining segments: `protected_remaining_s`) and the estimate's step time at n sequences. The live
    executions with a deadline are grouped by engine, and each engine's cap computed, once per instant."""

    def __init__(self, cluster: Cluster, config, history: Callable, loads: Callable[[], dict[int, float]]) -> None:
        self.cluster, self.config, self.history, self.loads = cluster, config, history, loads
        self.at, self.caps, self.by_engine, self.hist = -1.0, {}, {}, None

    def __call__(self, e: EngineView) -> int:
        now, c = self.cluster.now, self.config
        if self.at != now:
            self.at, self.caps, self.by_engine, self.hist = now, {}, {}, None
            for x in self.cluster.live():
                if x.deadline_at < float("inf"):
                    self.by_engine.setdefault(x.engine_id, []).append(x)
        if e.id not in self.caps:
            mine = self.by_engine.get(e.id)
            if not mine:
                self.caps[e.id] = e.admit_limit
            else:
                if self.hist is None:
                    self.hist = self.history()
                f = self.loads().get(e.id, 1.0)
                u, hist = c.protect_level, self.hist
                rem = [((remaining_s(x, hist, now, c.unseen_residual, f) if u is None else
                         protected_remaining_s(x, hist, now, c.unseen_residual, u, f)), x.deadline_at) for x in mine]
                per = e.kv_used / max(e.n_live, 1)
                est = self.cluster.estimate
                self.caps[e.id] = deadline_cap(rem, now, lambda n: est.step_s(n, n * per), e.n_live, e.admit_limit)
        return self.caps[e.id]
