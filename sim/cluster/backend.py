"""The simulated cluster: implements gyre.cluster.Cluster in simulated time.

Time is one gyre.sim.cluster.event_loop.EventLoop: engine events (segment ends, tool returns, prefills, KV
full: each engine's next wakeup) and timers (policy timeouts, role switches, training steps, weight syncs) in
one heap; at equal times engine events go first, and ties break by insertion order, so a run is a pure function
of (config, policy, seed).

Handle completions caused by engine events are deferred until that event is fully processed, so a
policy reacting to a finished execution never sees an engine half-way through an update.

Injected faults (`faults`, gyre.faults specs) are carried out by gyre.sim.cluster.faults.SimFaults, between events;
a killed engine is listed as "restarting" (not ready; it accepts admissions, which wait for it, and a stop,
carried out once it is back), as on the real backend. With no faults no code path changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gyre.cluster import ClusterError, Phase, Role
from gyre.config import ConfigError
from gyre.estimate import CostEstimate, from_costs
from gyre.gc_pause import no_gc
from gyre.handles import Handle, Process
from gyre.hardware import Costs, check_move_at, group_train_attention_ctx
from gyre.train_work import SAMPLING_STREAM, selected_work, selected_work_each
from gyre.trajectory.sample import SamplingConfig
from gyre.backend import PARK, ClusterBase, share_of
from gyre.engine_lifecycle import READY, STOPPING
from gyre.sim.cluster import engine_moves as moves
from gyre.sim.cluster.engine import SimEngine
from gyre.sim.cluster.execution import SimExecution, SimGroup
from gyre.sim.cluster.faults import SimFaults
from gyre.sim.cluster.event_loop import EventLoop
from gyre.sim.cluster.streaming import SimStep
from gyre.sim.cluster.invariants import check_cluster

_END_CODE = {"done": 0, "capped": 1, "deadline": 2}  # the finish record's third field (gyre.metrics)


class SimCluster(ClusterBase):
    def __init__(self, *, n_gpus: int, costs: Costs, source, check: bool = False, faults: tuple[str, ...] = (),
                 seed: int = 0, checkpoint_every: int = 0, cell_gpus: int = 0, standalone_gpus: int = 0,
                 sampling: SamplingConfig | None = None) -> None:
        self.loop = EventLoop()  # the clock and every event
        self._seed = seed
        # role-bounded path sampling: a step trains (and costs) the drawn paths only (gyre.train_work)
        self._sampling = sampling if sampling is not None and sampling.sampled else None
        self.costs = costs
        self.source = source
        self.init_books(n_gpus, gpus_per_engine=costs.engine_gpus, min_train_gpus=costs.min_train_gpus,
                        groups_per_step=source.config.groups_per_step, cell_gpus=cell_gpus,
                        standalone_gpus=standalone_gpus, steps_per_burst=getattr(source.config, "steps_per_burst", 1))
        self._dirty: list[SimEngine] = []  # engines whose next wakeup must be re-planned (SimEngine._touch)
        self.trained_groups: list[int] = []  # group ids in the order they were trained
        self.events = 0
        self.check = check
        self._kv_peak = 0.0  # the largest KV use of a stopped engine (tokens)
        self._roof_gpu_s = 0.0  # roofline-ideal GPU-seconds of stopped engines and of training
        self._faults = SimFaults(self, faults, seed, checkpoint_every) if faults else None
        self._estimate: CostEstimate | None = None
        try:
            check_move_at(costs.move_at, "cost.move_at")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._at_request = costs.move_at == "request"

    # ------------------------------------------------------------------ observations
    @property
    def now(self) -> float:
        return self.loop.now

    @property
    def estimate(self) -> CostEstimate:
        """The simulator's own derived costs, as a policy may know them (gyre.estimate)."""
        if self._estimate is None:
            self._estimate = from_costs(self.costs)
        return self._estimate

    def kv_peak_frac(self) -> float:
        """The largest KV use of any engine at any time so far, as a share of its capacity."""
        peak = max([self._kv_peak] + [e.kv_peak for e in self._engines.values()])
        return peak / self.costs.kv_capacity_tokens

    def roofline_gpu_s(self) -> float:
        """GPU-seconds the work done so far would take at the hardware's peak (the roofline's ideal time of
        every engine step, training at 100% MFU): utilization = this / (GPUs x makespan)."""
        live = 0.0
        for e in self._engines.values():
            e.advance(self.now)
            live += e.roof_s * len(e.gpus)
        return self._roof_gpu_s + live

    # ------------------------------------------------------------------ the scheduling surface of SimEngine
    def schedule(self, t: float, fn: Callable[[float, Any], None], arg: Any) -> None:
        """Call fn(t, arg) at simulated time t (an engine event; ties go in insertion order)."""
        self.loop.at(t, fn, arg)

    def wakeups(self) -> tuple[list, itertools.count]:
        """(the event heap, its engine events' tie-break counter), for an engine's own wakeups: heappush(heap, (t,
        next(counter), fn, arg)) is schedule(t, fn, arg) without a Python call on the hottest path."""
        return self.loop.heap, self.loop.tick

    def replan(self, engine: SimEngine) -> None:
        """Re-plan the engine's next wakeup once the current event is fully processed."""
        self._dirty.append(engine)

    def migrate_at_boundary(self, ex: SimExecution, t: float) -> None:
        """Carry out an execution's pending migration: it reached a tool-call boundary at t."""
        self._do_migrate(ex, t)

    # ------------------------------------------------------------------ internals
    def _after(self, dt: float, fn: Callable[[], None]) -> None:
        self.loop.after(dt, fn)

    def _succeed_after(self, seconds: float, h: Handle) -> None:
        self._after(seconds, lambda: h.succeed(None))

    def _at_boundary(self, ex: SimExecution) -> bool:
        # a tool call, a prefill, or queued; with move_at="request" a decoding one too (its request is cancelled)
        return ex.phase != Phase.DECODE or self._at_request

    def _migrate_now(self, ex: SimExecution) -> None:
        self._do_migrate(ex, self.now)

    def finish(self, ex: SimExecution, t: float, end: str) -> None:
        """An execution ended at t: "done", "capped" (its last segment, at the length cap) or "deadline"."""
        ex.finish(t, end)
        self.log.append(("finish", t, ex.id, _END_CODE[end], ex.generated))
        if self._faults is not None:
            self._faults.on_finish(t)
        self._deferred.append((ex.handle, ex))
        if ex.migrate_handle is not None:  # finished before reaching a tool-call boundary
            self._deferred.append((ex.migrate_handle, False))
            ex.migrate_to = ex.migrate_handle = None

    def _do_migrate(self, ex: SimExecution, t: float) -> None:
        """Move ex to its `migrate_to` (or park it) at t. Between turns (move_at="tool", or any execution that is
        not decoding) its pending tool call goes with it. Decoding (move_at="request"): its in-flight request is
        cancelled at the source, the tokens decoded in its segment discarded ("move_request" record), and the
        request is retried at the destination, which re-prefills the context before the segment or reads its KV
        (migration="kv_transfer"); the retry reaches it `request_s` after the move, and decodes once its KV is
        read too (the read starts at the move). Its deadline clock runs on untouched. A parked one's request is
        retried where it resumes. Readings: the source frees the request's KV at the move (the paper pins it
        until the destination confirms its read: that overlap is not modelled, as for tool-boundary moves);
        the GPU time of the discarded tokens is priced by engine_moves.cancel_request."""
        src, dst, h = ex.engine, ex.migrate_to, ex.migrate_handle
        ex.migrate_to = ex.migrate_handle = None
        cancelled = ex.phase == Phase.DECODE  # only with move_at="request" (_at_boundary)
        if cancelled:
            tokens, gpu_s = moves.cancel_request(src, ex, t)
            self._log(("move_request", t, ex.id, src.id, dst.id, tokens, gpu_s))
        kv = moves.remove(src, ex)  # the KV it held there, now freed
        if cancelled and dst is not PARK and self.costs.request_s:  # the retried request on its way
            ex.ready_at = t + self.costs.request_s
        if dst is PARK:  # off every engine, KV freed; a running tool call keeps its return time (ready_at)
            ex.park()
            self._log(("park", t, ex.id, src.id))
            self._deferred.append((h, True))
            return
        transfer = self.costs.migration == "kv_transfer" and kv > 0
        if transfer:  # the KV (and a hybrid model's state) travels; its context arrives resident if it fits there
            moved = (kv + self.costs.state_tokens) * self.costs.kv_transfer_s_per_token
            ex.ready_at = max(ex.ready_at if ex.ready_at is not None else t, t + moved)
        moves.add_migrated(dst, ex, t, kv if transfer else 0)
        self._log(("migrate", t, ex.id, src.id, dst.id))
        self._deferred.append((h, True))

    def _resume_now(self, ex: SimExecution, engine: SimEngine) -> None:
        t = self.now
        if ex.ready_at is not None and ex.ready_at <= t:  # its tool call returned while parked: it waits to run
            ex.ready_at = None
        moves.add_migrated(engine, ex, t)

    def _switch_in_s(self, gpus: Sequence[int], to: str) -> float:
        """Seconds until all of `gpus` serve as `to` ("engine" or "trainer"): the slowest one's switch."""
        resident = self.gpu_roles.resident
        return max([0.0] + [self.costs.switch_in_s(to, resident[g]) for g in gpus])

    # ------------------------------------------------------------------ verbs
    def next_group(self) -> SimGroup:
        spec = self.source.next_group()
        grp = SimGroup(spec, [SimExecution(s) for s in spec.executions])
        self._book_group(grp)
        return grp

    def start_engine(self, gpus: Sequence[int]) -> Handle:
        gpus, eid = self._check_start(gpus)
        eng = SimEngine(self, eid, gpus, self._published)
        dt = self._switch_in_s(gpus, "engine")
        self._place_engine(eng)
        h = Handle(f"start_engine{eid}")

        def up() -> None:
            self.gpu_roles.load(gpus, "engine")
            eng.transition(READY, self._published)
            eng.t_last = self.now
            self._engine_up(eng)
            h.succeed(eng)

        self._after(dt, up)
        return h

    def _stop_after_restart(self, eng: SimEngine, h: Handle) -> None:
        self._faults.stop_after_restart(eng, h)

    def _stop(self, eng: SimEngine, h: Handle) -> None:
        eng.transition(STOPPING)
        self.gpu_roles.set_role(eng.gpus, Role.SWITCHING, self.now)

        def down() -> None:
            self._kv_peak = max(self._kv_peak, eng.kv_peak)
            eng.advance(self.now)
            self._roof_gpu_s += eng.roof_s * len(eng.gpus)
            self._engine_down(eng)
            h.succeed(None)

        self._after(self.costs.engine_sleep_s, down)

    def admit(self, execution: SimExecution, engine: SimEngine) -> Handle:
        ex, eng = self._check_admit(execution, engine)
        if ex.max_ctx + self.costs.state_tokens + 2 > self.costs.kv_capacity_tokens * (1 - 1e-9):
            state = f" and a {self.costs.state_tokens:,.0f}-token state" if self.costs.state_tokens else ""
            raise ConfigError(f"execution {ex.id} reaches a {ex.max_ctx:,}-token context{state}; an engine holds "
                              f"{self.costs.kv_capacity_tokens:,} KV tokens (a larger model parallelism or GPU is needed)")
        t = self.loop.now
        self.log.append(("admit", t, ex.id, eng.id))
        moves.admit(eng, ex, t)
        return ex.handle

    def _sampled_each(self, group: SimGroup) -> list[tuple[int, float]]:
        """Per execution of a finished group, the (tokens, attention) it trains under role-bounded sampling: the
        draw `train` makes for the group (its seed stream), split by execution (a streaming step's micro-steps)."""
        done = [e.produced() for e in group.executions]
        rng = np.random.default_rng([self._seed, SAMPLING_STREAM, group.id])
        return selected_work_each(done, self.source.config, self._sampling, rng)[0]

    def train(self, gpus: Sequence[int], groups: Sequence[SimGroup]) -> Handle:
        gpus = self._check_train(gpus, groups)
        done = [[e.produced() for e in g.executions] for g in groups]  # a deadline cut trains what it produced
        tokens = sum(d[0].prompt + sum(x.tokens - x.prompt for x in d) for d in done)
        attn = sum(group_train_attention_ctx(d) for d in done)
        share = (1.0, 1.0)
        if self._sampling is not None:  # the drawn paths train: their work over the exact work above
            works = [selected_work(d, self.source.config, self._sampling,
                                   np.random.default_rng([self._seed, SAMPLING_STREAM, g.id]))
                     for d, g in zip(done, groups)]
            exact = (tokens, attn)
            tokens, attn = sum(x[0] for x in works), sum(x[1] for x in works)
            share = share_of(tokens, attn, *exact)
        v = self._version
        self.trained_groups.extend(g.id for g in groups)
        self._book_trained(groups, v)
        self._hold_for_training(gpus)
        onload = self._switch_in_s(gpus, "trainer")
        compute = self.costs.train_time(tokens, len(gpus), attn)
        h = Handle(f"train{v}")
        if onload > 0:
            self.gpu_roles.set_role(gpus, Role.SWITCHING, self.now)
        attempt = [0]  # a trainer fault voids the running attempt (gyre.sim.cluster.faults)

        def start() -> None:
            self.gpu_roles.load(gpus, "trainer")
            self.gpu_roles.set_role(gpus, Role.TRAIN, self.now)
            a = attempt[0]
            if self._faults is not None:
                self._faults.step_running(gpus, compute, attempt, start)
            self._after(compute, lambda: end(a))

        def end(a: int) -> None:
            if a != attempt[0]:
                return
            self._roof_gpu_s += compute * len(gpus) * self.costs.train_mfu
            self._step_done(gpus, tokens, share)
            if self._faults is not None:
                self._faults.step_ended(gpus, compute)
            h.succeed(self._version)

        begin = (lambda: self._after(onload, start)) if onload > 0 else start
        if self._faults is not None:
            begin = self._faults.before_step(gpus, begin)
        begin()
        return h

    def open_step(self, gpus: Sequence[int], groups: Sequence[SimGroup]) -> Handle:
        """A streaming step on `gpus` (the core cell) for `groups`, finished or not (gyre.sim.cluster.streaming)."""
        gpus = self._check_open(gpus, groups)
        h = Handle(f"step{self._version}")
        self._step = SimStep(self, gpus, groups, h)
        return h

    def extend_step(self, groups: Sequence[SimGroup]) -> Handle:
        self._step.add(self._check_extend(groups))
        return Handle("extend_step").succeed(None)

    def join_step(self, gpus: Sequence[int]) -> Handle:
        return self._step.join(self._check_join(gpus))

    def leave_step(self, gpus: Sequence[int]) -> Handle:
        return self._step.leave(self._check_leave(gpus))

    def _sync_now(self, todo: list[SimEngine], v: int, h: Handle) -> Handle:
        if self._faults is not None and self._faults.faulty_sync(todo, v, h):
            return h
        for e in todo:
            moves.pause(e, self.now)
        t0 = self.now

        def done() -> None:
            for e in todo:
                if self._faults is not None and self._faults.lost(e, t0):
                    continue  # killed meanwhile: it restarts with the latest weights
                moves.resume_decoding(e, self.now, v)
                self._log(("sync", self.now, e.id, v))
            h.succeed(None)

        self._after(self.costs.sync_s, done)
        return h

    # ------------------------------------------------------------------ running
    def run(self, policy, steps: int, progress: Callable[[int, float], None] | None = None) -> Process:
        """Run `policy` until it returns; raise its error or a deadlock as ClusterError.

        Python's cycle collector is paused meanwhile: the loop allocates millions of small acyclic
        objects (heap entries, log records) that it would rescan again and again as the heap grows
        (about a quarter of the run time at 1M executions); the few cycles a run makes are collected
        after it."""
        with no_gc():
            return self._run(policy, steps, progress)

    def _run(self, policy, steps: int, progress: Callable[[int, float], None] | None) -> Process:
        proc = Process(policy.run(self, steps), label=getattr(policy, "name", "policy"))
        faults = self._faults
        if faults is not None:
            faults.start(steps * self.groups_per_step * self.source.config.group_size)
        loop = self.loop
        last_version = -1
        events, check = 0, self.check
        plain = not check and progress is None and faults is None  # nothing to do between events but run them
        ended: list[bool] = []
        proc.on_done(lambda _h: ended.append(True))
        self._release_deferred()
        self._flush()
        try:
            while not ended:
                # events in time order while none leaves work behind (gyre.sim.cluster.event_loop)
                n = loop.run(self._deferred, self._dirty, plain)
                if not n:  # nothing can run
                    if proc.error is not None:  # the policy failed: its error, not the deadlock it left
                        raise proc.error
                    raise ClusterError(f"deadlock at t={self.now:.1f}s: the policy waits on nothing")
                events += n
                if self._deferred:
                    self._release_deferred()
                if self._dirty:
                    self._flush()
                if faults is not None and loop.now >= faults.next_at:
                    faults.tick()
                    self._release_deferred()
                    self._flush()
                if check:
                    self.check_invariants()
                if progress is not None and self._version != last_version:
                    last_version = self._version
                    progress(self._version, self.now)
        finally:
            self.events += events
        if proc.error is not None:
            raise proc.error
        return proc

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for e in dirty:
            e.replan_pending()

    def check_invariants(self) -> None:
        """Assert the cluster's invariants now (gyre.sim.cluster.invariants.check_cluster)."""
        check_cluster(self, self._engines.values())
