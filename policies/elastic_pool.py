"""The elastic controller's engines: `EnginePool` carries out what the controller decides and is the only writer
of their state. No execution is aborted: one left on a drained engine all the same (moved back by a fault's
restart, or joined meanwhile) is parked and resumed where room frees. Simplifications: one drain or lend in
flight at a time; engines start and stop whole."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView, Phase
from gyre.handles import Handle, all_of
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Signal, engine_slots
from gyre.policies.elastic_forecast import frees_sooner
from gyre.policies.elastic_plan import DrainPlan, plan_drain
from gyre.policies.placement import spread_moves


class EnginePool:
    def __init__(self, cluster: Cluster, *, kv_fill: float, load_share: float, max_running: int | None,
                 cap: Callable[[EngineView], int], move_to_consolidate: Callable[[], bool]) -> None:
        self.cluster = cluster
        self.kv_fill, self.load_share, self.max_running = kv_fill, load_share, max_running  # ElasticConfig
        self.cap = cap  # the deadline cap (`DeadlineCaps`)
        self.move_to_consolidate = move_to_consolidate  # may a consolidation move live executions now (elastic, 3.)
        self.engines: list[EngineView] = []  # engines that accept admissions (starting or ready)
        self.peak: dict[int, int] = {}  # engine id -> the most live executions it has carried
        self.draining: Handle | None = None  # the one drain in flight
        self.lending: Handle | None = None  # the one lend in flight
        self.load = Signal()  # an execution finished, or the pool changed
        self.starting = 0  # engines started and not yet serving
        self.reserve = 0  # free GPUs kept for the trainer: never lent
        self.hold = False  # admission held: no engine is handed anything (elastic, 1.)
        self.admission = AdmissionQueue(cluster, self.ready, limit=self.quota)
        self.moving: dict[int, tuple[Handle, int]] = {}  # execution id -> its move in flight and its target

    def set_reserve(self, gpus: int) -> None:
        self.reserve = gpus

    def hold_admission(self, hold: bool) -> None:
        self.hold = hold

    def most(self, e: EngineView) -> int:
        """The executions `e` may carry after a drain: its admission limit within `max_running`."""
        return e.admit_limit if self.max_running is None else min(e.admit_limit, self.max_running)

    def drain_room(self, e: EngineView) -> int:
        """Migrants `e` may still take (within `most`, not the deadline cap)."""
        return self.most(e) - e.n_live - self.admission.incoming.get(e.id, 0)

    def quota(self, e: EngineView) -> int:
        """The executions `e` may be handed: none while admission holds, else within `even_part`, `max_running`
        and the deadline cap."""
        if self.hold:
            return 0
        n = self.even_part(e) if self.max_running is None else min(self.even_part(e), self.max_running)
        return min(n, self.cap(e))

    def even_part(self, e: EngineView) -> int:
        """While engines start, an even part of the work over the ready and starting engines: an execution
        waits the start rather than slow a crowded engine's every step for its whole life."""
        if not self.starting:
            return e.admit_limit
        ready = self.ready()
        work = sum(x.n_live for x in ready) + len(self.admission)
        return max(1, -(-work // (len(ready) + self.starting)))

    def ready(self) -> list[EngineView]:
        return [e for e in self.engines if e.ready]

    @property
    def idle(self) -> bool:
        return self.in_flight() is None

    def in_flight(self) -> Handle | None:
        """The drain or lend in flight, if any."""
        return next((h for h in (self.draining, self.lending) if h is not None and not h.done), None)

    def move(self, x: ExecutionView, target: EngineView) -> Handle:
        """Migrate `x` at its next tool-call boundary; one already moving keeps its move."""
        if x.id in self.moving:
            return self.moving[x.id][0]
        h = self.admission.move(x, target)
        self.moving[x.id] = (h, target.id)
        h.on_done(lambda _h, i=x.id: self.moving.pop(i, None))
        return h

    def park(self, x: ExecutionView) -> Handle:  # one moving: its move (the caller looks again)
        return self.moving[x.id][0] if x.id in self.moving else self.admission.park(x)

    def moves_into(self, ids: set[int]) -> list[Handle]:
        return [h for h, t in self.moving.values() if t in ids]

    def grow(self, sync: bool = True, engines: int | None = None):
        """Start `engines` engines (None: as many as the free GPUs take) and sync stale ones; yields until all serve."""
        stale = [e for e in self.engines if e.ready and e.version < self.cluster.version] if sync else []
        waits = self._start(engines)
        n = len(waits)
        if stale:
            waits.append(self.cluster.sync(stale))
        if waits:
            done = yield all_of(waits)
            self._joined(done[:n])

    def keep(self, engines: int) -> int:
        """Stop all but the first `engines` empty ready engines, without waiting; returns the GPUs they free."""
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
        """Start engines without waiting: they join once they serve."""
        waits = self._start(engines)
        if waits:
            self.starting += len(waits)

            def joined(h: Handle) -> None:
                self.starting -= len(waits)
                self._joined(h.value if h.error is None else [])

            all_of(waits).on_done(joined)

    def _start(self, engines: int | None) -> list[Handle]:
        slots = engine_slots(sorted(self.cluster.free_gpus()), self.cluster.gpus_per_engine)
        slots = slots if engines is None else slots[:engines]
        if slots:
            self.cluster.note("elastic_grow", engines=len(slots))
        return [self.cluster.start_engine(s) for s in slots]

    def _joined(self, engines: Sequence[EngineView]) -> None:
        self.engines.extend(engines)
        self.admission.pump()
        self.load.fire()

    def drain(self, plan: DrainPlan, why: str):
        """Empty the plan's engines (moves, parks; one still there once its move is done is parked), stop them."""
        cluster, ids = self.cluster, {e.id for e in plan.victims}
        self.engines = [e for e in self.engines if e.id not in ids]
        cluster.note("elastic_drain", why=why, engines=sorted(ids), moves=len(plan.moves), parks=len(plan.parks))
        yield all_of([self.move(x, t) for x, t in plan.moves] + [self.park(x) for x in plan.parks]
                     + self.moves_into(ids))
        left = [x for x in cluster.live() if x.engine_id in ids]
        while left:
            yield all_of([self.park(x) for x in left] + self.moves_into(ids))
            left = [x for x in cluster.live() if x.engine_id in ids]
        yield all_of([cluster.stop_engine(e) for e in plan.victims])
        self.draining = None
        self.load.fire()

    def lend_reserve(self, decide: Callable[[], bool]) -> None:
        """Once this instant's events are in, if `decide()`: engines on the reserve, the live executions spread
        evenly over old and new engines (`spread_moves`) at their tool-call boundaries."""
        def lend():
            yield self.cluster.timeout(0.0)
            if decide():
                self.reserve = 0
                yield from self.grow(sync=False)
                moves = spread_moves(self.ready(), self.cluster.live(), kv_fill=self.kv_fill, slots=self.drain_room)
                self.cluster.note("elastic_release", engines=len(self.engines), moves=len(moves))
                if moves:
                    yield all_of([self.move(x, t) for x, t in moves])
                self.load.fire()
            self.lending = None

        self.lending = self.cluster.spawn(lend(), "elastic-release")

    def between_decisions(self, batch_waiting: bool, predict: Callable[[Sequence[ExecutionView]], tuple[dict, dict]]
                          ) -> None:
        """With no batch ready and nothing in flight: where executions wait for room, lend free GPUs beyond the
        reserve or rebalance; else consolidate (`predict(xs)`: finishes and boundary waits of xs)."""
        ready = self.ready()
        for e in ready:
            self.peak[e.id] = max(self.peak.get(e.id, 0), e.n_live)
        if not self.idle or len(ready) != len(self.engines) or batch_waiting:
            return
        if len(self.admission) > 0 or any(e.n_queued for e in ready):
            lendable = (len(self.cluster.free_gpus()) - self.reserve) // self.cluster.gpus_per_engine
            if lendable > 0:
                self.lending = self.cluster.spawn(self._lend(lendable), "elastic-grow")
            else:
                self.rebalance(ready)
        else:
            self.consolidate(ready, predict)

    def _lend(self, engines: int):
        yield from self.grow(sync=False, engines=engines)
        self.rebalance(self.ready())
        self.lending = None
        self.load.fire()

    def rebalance(self, ready: list[EngineView]) -> None:
        """Executions queued for KV on an engine move to engines that queue nothing and have room (free KV below
        kv_fill after the move), largest context first."""
        q = self.admission
        free = {e.id: self.kv_fill * e.kv_capacity - e.kv_used for e in ready if not e.n_queued and q.room(e) > 0}
        if not free or max(free.values()) <= 0:
            return
        full = {e.id for e in ready if e.n_queued}
        queued = [x for x in self.cluster.live() if x.phase == Phase.QUEUED and x.engine_id in full]
        by_id = {e.id: e for e in ready}
        for x in sorted(queued, key=lambda x: (-x.context_tokens, x.id)):
            tid = max(free, key=lambda i: (free[i], -i))
            need = max(x.context_tokens, 1)
            if free[tid] < need:
                continue
            free[tid] -= need
            if q.room(by_id[tid]) <= 1:
                del free[tid]
            self.move(x, by_id[tid])
            if not free:
                return

    def consolidate(self, ready: Sequence[EngineView], predict: Callable[[Sequence[ExecutionView]], tuple[dict, dict]]
                    ) -> None:
        """Drain the engines below `load_share` of their peak whose executions all fit elsewhere and move before
        they would finish (`frees_sooner`); without `move_to_consolidate()`, only engines left empty."""
        move = self.move_to_consolidate()
        thin = {e.id for e in ready if e.n_live < self.load_share * self.peak.get(e.id, 0) and (move or not e.n_live)
                and not self.admission.incoming.get(e.id)}  # one with a move on its way is a target
        if not thin or len(ready) < 2:
            return
        live = self.cluster.live()
        on: dict[int, list[ExecutionView]] = {}
        for x in live:
            if x.engine_id in thin:
                on.setdefault(x.engine_id, []).append(x)
        if on:
            finish, waits = predict([x for xs in on.values() for x in xs])
            thin = {i for i in thin if i not in on or frees_sooner(on[i], finish, waits, self.cluster.now)}
        for k in range(len(thin), 0, -1):
            plan = plan_drain(ready, live, k, kv_fill=self.kv_fill, slots=self.drain_room)
            if not plan.parks and all(e.id in thin for e in plan.victims):
                self.draining = self.cluster.spawn(self.drain(plan, "consolidate"), "elastic-consolidate")
                return
