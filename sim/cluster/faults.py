"""Injected faults in the simulator: the real backend's fault specs (gyre.faults), carried out in simulated time.

The specs, the moments they fire and their targets are gyre.faults.FaultInjector's, drawn from the run's seed
exactly as on the real backend; `tick` runs at the moments it names and after each finish. What each fault
does, as the real backend does it (its flow, train_step and weights modules):

- kill-engine: the engine's process dies. Its KV and in-flight work are lost (gyre.sim.cluster.engine_moves.wipe:
  the unfinished part of a segment is decoded again; nothing of it was recorded). Its executions move, in id
  order, each to the ready engine then holding the fewest (ties by id), and re-prefill their whole context there
  (a tool call keeps running); with no other engine ready they wait for it. Its GPUs switch for `Costs.engine_restart_s`
  (gyre.hardware: start-up + weight load), then it is ready with the trainer's latest version, which it reports
  while restarting too; a stop asked meanwhile is carried out once it is back.
- kill-trainer: each GPU's trainer worker holds a version (`held`); the worker of record holds the latest. A
  kill during a step voids it: its ranks' state is unknown and the step runs again on the same GPUs with the
  same batch once the worker is back (`Costs.trainer_restart_s`). If no worker holds the latest state any more,
  it is rebuilt first: from the last checkpoint (every `checkpoint_every` steps; with none, from the run's
  starting weights) by replaying the steps since. A kill outside a step loses the worker of record; another
  holder takes over, or the next step waits for the rebuild; a step never starts before its workers are back.
  Versions continue; nothing trained is lost. During a streaming step (gyre.sim.cluster.streaming) the victim is
  a rank of any of its cells (`step_in_flight`: every cell's GPUs, the core's first, so a cell is hit in
  proportion to its size, as on the real backend); the cell's micro-steps go back to the queue
  (SimStep.worker_lost), its GPUs switch until the worker is back; a lost satellite then leaves, the core trains
  on once its workers are back and the state of record (rebuilt if no worker holds it). A step's end, an open
  and a join wait likewise (`trainer_ready_at`), and a streaming step replays at the time `train` would take for
  its whole batch on the core's GPUs.
- delay-sync:S: the sync starts S seconds late (engines keep generating on their weights meanwhile).
- drop-sync: one engine misses the sync; it is sent again after SYNC_TIMEOUT_S.
The log gets the real backend's notes: fault, engine_fault, engine_restarted, trainer_fault, step_retry,
trainer_recovered, sync_resent (gyre.faults.fault_summary counts them).

Simplifications: a replay runs on the retried step's GPUs at each replayed step's own compute time (the real
backend replays on one worker); writing a checkpoint and handing the state of record to a stale worker are free;
the per-token version lag counts a lost partial segment's tokens at the version that first decoded them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gyre.engine_lifecycle import READY, RESTARTING
from gyre.cluster import ClusterError, EngineView, Role
from gyre.faults import KILLS, SYNC_TIMEOUT_S, FaultInjector, parse_faults
from gyre.handles import Handle
from gyre.sim.cluster import engine_moves as moves

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster
    from gyre.sim.cluster.engine import SimEngine


class SimFaults:
    def __init__(self, cluster: SimCluster, specs: tuple[str, ...], seed: int, checkpoint_every: int) -> None:
        self.c = cluster
        self.injector = FaultInjector(parse_faults(specs), seed)
        self.next_at = math.inf  # the run loop calls `tick` once simulated time reaches this
        self._woken: set[float] = set()  # wakeups already scheduled
        self._killed_at: dict[int, float] = {}  # engine id -> its last fault
        self._stop_after: dict[int, Handle] = {}  # engine id -> a stop asked while it restarts
        self.every = checkpoint_every
        self.held: list[int | None] = [0] * cluster.n_gpus  # the version each trainer worker holds (None: lost)
        self.record: int | None = 0  # the worker holding the latest version (None: it must be rebuilt)
        self.ckpt_version = 0  # the rebuild starts here (the run's starting weights, or the last checkpoint)
        self.step_s: dict[int, float] = {}  # version -> compute time of the step that made it, since the checkpoint
        self.step: tuple | None = None  # the step computing now: (GPUs, compute s, attempt counter, its start)
        self.lost_at = 0.0  # when the state of record was last lost
        self.lost_gpu = 0  # the GPU whose worker held it (a rebuild happens there)
        self.back_at: dict[int, float] = {}  # GPU -> when its replaced trainer worker is up
        self._counting = False  # a progress fault waits for finishes

    # --- what FaultInjector reads ---
    @property
    def now(self) -> float:
        return self.c.now

    @property
    def log(self) -> list[tuple]:
        return self.c.log

    def engines(self) -> list[EngineView]:
        return self.c.engines()

    def note(self, kind: str, **fields) -> None:
        self.c.note(kind, **fields)

    def step_in_flight(self) -> tuple[int, ...]:
        """The running `train` step's GPUs, or every GPU of a cell of the open streaming step (the core's first,
        cells in join order, those switching in included), or ()."""
        if self.step is not None:
            return self.step[0]
        return self.c._step.gpus() if self.c._step is not None else ()

    def worker_of_record(self) -> int | None:
        return self.record

    # --- when to tick ---
    def start(self, total_executions: int) -> None:
        self.injector.start(total_executions)
        self._plan()

    def tick(self) -> None:
        self.injector.tick(self)
        self._plan()

    def on_finish(self, t: float) -> None:
        """An execution finished: progress faults may now have a moment (FaultInjector counts from the log)."""
        if self._counting and t < self.next_at:
            self.next_at = t

    def _plan(self) -> None:
        now = self.c.now
        inj = self.injector
        self.next_at = t = inj.wake_at(now)
        self._counting = any(f.kind in KILLS and f.at_progress is not None and i not in inj.due_at
                             for i, f in enumerate(inj.pending))
        if now < t < math.inf and t not in self._woken:  # an event at t, so the fault fires on time
            self._woken.add(t)
            self.c.schedule(t, lambda _t, _a: None, None)

    # --- engines ---
    def kill_engine(self, engine_id: int) -> None:
        c, t = self.c, self.c.now
        eng = c._engines.get(engine_id)
        if eng is None or not eng.ready:
            raise ClusterError(f"kill_engine: engine {engine_id} is not running")
        execs, lost = moves.wipe(eng, t)
        eng.transition(RESTARTING, c.published_version)  # the version it will serve (see step_ended)
        self._killed_at[eng.id] = t
        c.gpu_roles.set_role(eng.gpus, Role.SWITCHING, t)
        others = [e for e in c._engines.values() if e.ready]
        c.note("engine_fault", engine=eng.id, executions=[x.id for x in execs],
               moved=len(execs) if others else 0, tokens_lost=lost, reprefill_tokens=sum(x.ctx for x in execs))
        for ex in execs:
            dst = min(others, key=lambda e: (e.n_live, e.id)) if others else eng
            if ex.migrate_handle is not None:  # a migration the policy asked for: at this boundary, if it can
                to, h = ex.migrate_to, ex.migrate_handle
                ex.migrate_to = ex.migrate_handle = None
                if to.ready:
                    dst = to
                c._deferred.append((h, to.ready))
            moves.add_migrated(dst, ex, t)
            if dst is not eng:
                c._log(("migrate", t, ex.id, eng.id, dst.id))
        c._after(c.costs.engine_restart_s, lambda: self._restarted(eng))

    def _restarted(self, eng: SimEngine) -> None:
        c, t = self.c, self.c.now
        eng.transition(READY, c.published_version)
        c.gpu_roles.set_role(eng.gpus, Role.ROLLOUT, t)
        c.note("engine_restarted", engine=eng.id, version=c.published_version, recovery_s=t - self._killed_at[eng.id])
        h = self._stop_after.pop(eng.id, None)
        if h is not None:
            c._stop(eng, h)
            return
        moves.restarted(eng, t)

    def stop_after_restart(self, eng: SimEngine, h: Handle) -> None:
        self._stop_after[eng.id] = h

    def lost(self, eng: SimEngine, since: float) -> bool:
        """Whether the engine was killed at or after `since` (a sync it was in no longer applies)."""
        return self._killed_at.get(eng.id, -1.0) >= since

    # --- weight syncs ---
    def faulty_sync(self, todo: list[SimEngine], v: int, h: Handle) -> bool:
        """Carry out a sync that a delay-sync or drop-sync fault hits now; False if none does."""
        fault = self.injector.take_sync_fault(self, todo)
        if fault is None:
            return False
        c, t0 = self.c, self.c.now
        left = [len(todo)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                h.succeed(None)

        def load(e: SimEngine) -> None:
            if self.lost(e, t0) or e.state is not READY:  # died or stopped meanwhile
                one_done()
                return
            moves.pause(e, c.now)

            def done() -> None:
                if not self.lost(e, t0):
                    moves.resume_decoding(e, c.now, v)
                    c._log(("sync", c.now, e.id, v))
                one_done()

            c._after(c.costs.sync_s, done)

        def resend(e: SimEngine) -> None:
            c.note("sync_resent", engine=e.id, version=v)
            load(e)

        for e in todo:
            if fault[0] == "delay":
                c._after(fault[1], lambda e=e: load(e))
            elif e.id == fault[1]:
                c._after(SYNC_TIMEOUT_S, lambda e=e: resend(e))
            else:
                load(e)
        return True

    # --- the trainer ---
    def kill_trainer(self, gpu: int) -> None:
        c, t = self.c, self.c.now
        in_step = self.step is not None and gpu in self.step[0]
        streaming = c._step if c._step is not None and gpu in c._step.gpus() else None
        if self.record is not None:
            self.lost_at = t
        c.note("trainer_fault", worker=gpu, version=c.version, in_step=in_step or streaming is not None,
               record=gpu == self.record)
        self.held[gpu] = None
        self.back_at[gpu] = t + c.costs.trainer_restart_s
        if in_step:
            gpus, compute, attempt, start = self.step
            self.step = None
            attempt[0] += 1  # the running attempt's end no longer counts
            for g in gpus:
                self.held[g] = None  # mid-step state: unknown
            c.note("step_retry", version=c.version + 1, gpus=list(gpus))
            c.gpu_roles.set_role(gpus, Role.SWITCHING, t)
        if self.record is not None and self.held[self.record] is None:
            self.lost_gpu = self.record
            holders = [g for g, v in enumerate(self.held) if v == c.version]
            self.record = holders[0] if holders else None
        if in_step:
            c._after(self._recovery_s(t) - t, self.rebuilt_then(start))
        if streaming is not None:
            streaming.worker_lost(gpu)

    def _recovery_s(self, t: float) -> float:
        """When the state of record is back: the worker's restart, then a rebuild's replay if it was lost."""
        back = max(t, self.lost_at + self.c.costs.trainer_restart_s)
        if self.record is None:
            back += sum(self.step_s.get(v, 0.0) for v in range(self.ckpt_version + 1, self.c.version + 1))
        return back

    def rebuilt_then(self, go):
        """`go`, after the state of record is rebuilt on the lost record's GPU if it was lost."""
        def run() -> None:
            if self.record is None:
                c, g = self.c, self.lost_gpu
                self.record, self.held[g] = g, c.version
                c.note("trainer_recovered", worker=g, version=c.version, from_version=self.ckpt_version,
                       replayed=c.version - self.ckpt_version, recovery_s=c.now - self.lost_at)
            go()
        return run

    def trainer_ready_at(self, gpus: tuple[int, ...], record: bool) -> float:
        """When the trainer workers of `gpus` are all up (a replaced one once its restart ends) and, with `record`
        (the GPUs will hold the state of record: a streaming step's core), the state of record is back too."""
        t = self.c.now
        ready = max([t] + [self.back_at.get(g, t) for g in gpus])
        if record and self.record is None:
            ready = max(ready, self._recovery_s(t))
        return ready

    def before_step(self, gpus: tuple[int, ...], begin):
        """A step starts once its workers are back and, if no worker holds the latest state, it is rebuilt."""
        c, t = self.c, self.c.now
        ready = max([t] + [self.back_at.get(g, t) for g in gpus])
        if self.record is not None and ready <= t:
            return begin
        if self.record is None:
            ready = max(ready, self._recovery_s(t))

        def wait() -> None:
            c.gpu_roles.set_role(gpus, Role.SWITCHING, t)
            c._after(ready - t, self.rebuilt_then(begin))
        return wait

    def step_running(self, gpus: tuple[int, ...], compute: float, attempt: list[int], start) -> None:
        self.step = (gpus, compute, attempt, start)

    def step_ended(self, gpus: tuple[int, ...], compute: float) -> None:
        """A step ended (the version is booked): its ranks hold it; restarting engines will serve it."""
        self.step = None
        v = self.c.version
        for g in gpus:
            self.held[g] = v
        self.record = gpus[0]
        self.step_s[v] = compute
        if self.every and v % self.every == 0:
            self.ckpt_version, self.step_s = v, {}
        for e in self.c._engines.values():
            if e.state is RESTARTING:
                e.serve(self.c.published_version)
