"""The real cluster: implements gyre.cluster.Cluster on Ray actors, in wall-clock time.

The same policy objects that run in the simulator run here unchanged. The driver process owns all
bookkeeping (GPU roles and owners, engine membership, execution phases, the event log in the schema
of gyre.metrics); actors do the work: engines generate (gyre.real.engine_torch), tool workers
run tool calls (gyre.real.tools) and score finished groups (gyre.real.verify), trainer workers train and
publish weights (gyre.real.trainer).

What is shared with the simulator (observations, preconditions, booking) is gyre.backend.ClusterBase.
The data-parallel training step is gyre.real.train_step, the streaming step on cells gyre.real.streaming (its
workers' side gyre.real.cell_worker), weight publishing gyre.real.weights, and how
executions flow through engines, migrations and engine faults gyre.real.flow (mixins of this class): no
execution is ever aborted or restarted.

The run loop drives the policy's gyre.handles.Process: it waits on the outstanding Ray futures with
`ray.wait` (bounded by the next policy timer), and handles the completed ones in submission order;
handle completions are deferred until a result is fully booked, so a policy never observes an engine
half-way through an update. Times in the log are seconds since the cluster was built.
"""

from __future__ import annotations

import heapq
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from gyre.cluster import ClusterError, Phase, Role
from gyre.estimate import CostEstimate
from gyre.handles import Handle, done_handle, Process
from gyre.hardware import admission_limit
from gyre.backend import ClusterBase
from gyre.engine_lifecycle import READY, RESTARTING, STOPPING
from gyre.real.component_config import RealClusterConfig
from gyre.real.execution import RealExecution, RealGroup
from gyre.real.engine_view import RealEngine
from gyre.faults import FaultInjector, parse_faults
from gyre.real.flow import ExecutionFlow
from gyre.real.profile import cluster_estimate
from gyre.real.task_api import load_task
from gyre.real.tools import ToolService
from gyre.real.verify import Verifier
from gyre.real.streaming import RealStep
from gyre.real.train_step import TrainSteps
from gyre.real.weights import WeightPublisher
from gyre.trajectory import AdvantageConfig, group_advantages
from gyre.trajectory.credit import MEMBER_OUTCOMES


class RealCluster(ExecutionFlow, TrainSteps, WeightPublisher, ClusterBase):
    def __init__(self, *, pool, config: RealClusterConfig) -> None:
        self.pool = pool
        self.cfg = config
        self.init_books(pool.cfg.n_gpus, gpus_per_engine=pool.cfg.gpus_per_engine,
                        min_train_gpus=config.min_train_gpus, groups_per_step=config.groups_per_step,
                        cell_gpus=config.cell_gpus, standalone_gpus=config.standalone_gpus,
                        steps_per_burst=config.steps_per_burst)
        self.task = load_task(config.task_class, config.task, config.seed, check=False)
        self._pending: dict[Any, tuple[int, Callable[[Any, BaseException | None], None]]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._background: list = []
        self.profile: dict[str, list] = {"wake": [], "sleep": [], "train": [], "sync": [], "migration": [], "requests": []}
        if config.weight_sync == "collective" and not all(hasattr(a, "receive_weights") for a in pool._engines.values()):
            raise ValueError(f"RealClusterConfig.weight_sync = 'collective' needs engines with receive_weights(group, "
                             f"version); engine {pool.cfg.engine!r} has none (use 'object_store')")
        pool.heal()  # actors an earlier run lost
        ray.get([a.sleep.remote() for a in pool._engines.values()])  # engines of an earlier run
        # before the trainers' reset: a start-up profile's training steps leave nothing behind
        self._estimate, self.estimate_profile_s = cluster_estimate(pool, config, self.task.max_context)
        base = ray.get([t.reset.remote(config.seed) for t in pool.trainers])[0]
        if config.checkpoint and Path(config.checkpoint).exists():
            base = ray.get([t.load.remote(config.checkpoint) for t in pool.trainers])[0]
        every = config.checkpoint_every if config.checkpoint_every is not None else (1 if config.checkpoint else 0)
        self._tmp = tempfile.mkdtemp(prefix="gyre-ckpt-") if every and not config.checkpoint else None
        ckpt = config.checkpoint or (str(Path(self._tmp) / "trainer.pt") if self._tmp else None)
        self._init_steps(base, len(pool.trainers), ckpt, every)
        # object ref of the latest version's snapshot, made before the version is booked (engines load it even
        # while a lost trainer worker's state is rebuilt)
        self._weights, ack = pool.trainers[0].publish.remote(base)
        ray.get(ack)  # the snapshot itself stays in the object store, out of the driver's process
        self.injector = FaultInjector(parse_faults(config.faults), config.seed)
        self.tools = ToolService(config.tools, pool.tools, self._submit, self._call_after,
                                 log=lambda kind, info: self._log(("note", self.now, kind, info)))
        # a group is scored on the tool workers once it finishes (retried within the evaluation budget)
        self.verifier = Verifier(self.task, self.tools, lambda kind, info: self._log(("note", self.now, kind, info)),
                                 lambda: self.now, retries=config.tools.eval_retries)
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ observations
    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def estimate(self) -> CostEstimate:
        if self._estimate is None:
            raise ClusterError("real backend: no cost estimate (cluster.estimate = 'none'; set it to 'profile' or "
                               "to a calibration file written by `gyre-real calibrate --estimate-out`)")
        return self._estimate

    @property
    def trainer_version(self) -> int:
        """The trainer's version of record (base_version + version once no step runs)."""
        return self._tv

    def trainer_weights(self) -> dict:
        """The latest published weights, as the worker of record holds them (tests, benchmarks)."""
        return ray.get(self.pool.trainers[self._record].weights.remote(self._tv))

    # ------------------------------------------------------------------ internals
    def _submit(self, ref, fn: Callable[[Any, BaseException | None], None]) -> None:
        self._seq += 1
        self._pending[ref] = (self._seq, fn)

    def _busy(self, eng: RealEngine) -> None:
        b = any(x.phase == Phase.DECODE for x in eng.members.values())
        if b != eng.busy:
            eng.busy = b
            self._log(("busy", self.now, eng.id, int(b)))

    # ------------------------------------------------------------------ verbs
    def next_group(self) -> RealGroup:
        gid, redraw = len(self.groups), self.cfg.redraw
        index = redraw[gid] if gid < len(redraw) else self.cfg.first_task + gid - len(redraw)
        grp = RealGroup(gid, index, self.task.new_group(index, self.cfg.group_size), len(self.executions))
        self._book_group(grp)
        return grp

    def start_engine(self, gpus: Sequence[int]) -> Handle:
        gpus, eid = self._check_start(gpus)
        v = self._published
        limit = admission_limit(self.cfg.kv_capacity, self.task.max_context, self.cfg.admission_fill)
        eng = RealEngine(eid, gpus, self.pool.engine(gpus), v, self.cfg.kv_capacity, limit)
        self._place_engine(eng)
        h = Handle(f"start_engine{eid}")
        t0 = self.now

        def up(dt, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):  # its actor died: a new one
                self._log(("note", self.now, "engine_fault", {"engine": eid, "executions": []}))
                self._restart_start(eng, up)
                return
            if err is not None:
                raise ClusterError(f"start_engine: engine {eid} on GPUs {gpus} failed: {err}")
            eng.transition(READY)
            self.profile["wake"].append(self.now - t0)
            self._engine_up(eng)
            self._deferred.append((h, eng))

        self._wake(eng, v, up)
        return h

    def _restart_start(self, eng: RealEngine, up) -> None:
        eng.actor = self.pool.respawn(eng.gpus)
        eng.serve(self._published)
        self._wake(eng, self._published, up)

    def _stop_after_restart(self, eng: RealEngine, h: Handle) -> None:
        eng.stop_after_restart = h

    def _stop(self, eng: RealEngine, h: Handle) -> None:
        eng.transition(STOPPING)
        self.gpu_roles.set_role(eng.gpus, Role.SWITCHING, self.now)
        t0 = self.now

        def down(_dt, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):  # it died: down anyway; the slot gets a new actor
                self._log(("note", self.now, "engine_fault", {"engine": eng.id, "executions": []}))
                self.pool.respawn(eng.gpus)
            elif err is not None:
                raise ClusterError(f"stop_engine: engine {eng.id} failed to sleep: {err}")
            self.profile["sleep"].append(self.now - t0)
            self._engine_down(eng)
            self._deferred.append((h, None))

        self._submit(eng.actor.sleep.remote(), down)

    def admit(self, execution: RealExecution, engine: RealEngine) -> Handle:
        ex, eng = self._check_admit(execution, engine)
        self._log(("admit", self.now, ex.id, eng.id))
        ex.engine = eng
        eng.members[ex.id] = ex
        eng.queue.append(ex)
        self._start_queued(eng)
        return ex.handle

    def _at_boundary(self, ex: RealExecution) -> bool:
        """Tool-call boundaries; with `move_in_flight`, a decoding execution too (its request moves with it)."""
        return ex.phase in (Phase.TOOL, Phase.QUEUED) or (self.cfg.move_in_flight and ex.phase == Phase.DECODE)

    def _migrate_now(self, ex: RealExecution) -> None:
        self._do_migrate(ex, inflight=ex.phase == Phase.DECODE)  # decoding: only with cfg.move_in_flight
        self._release_deferred()

    def train(self, gpus: Sequence[int], groups: Sequence[RealGroup]) -> Handle:
        gpus = self._check_train(gpus, groups)
        if self._step is not None:
            raise ClusterError(f"train: the streaming step training version {self._step.version} is still open")
        v = self._version
        self._book_trained(groups, v)
        self._hold_for_training(gpus)
        self.gpu_roles.set_role(gpus, Role.TRAIN, self.now)
        h = Handle(f"train{v}")
        adv_cfg = AdvantageConfig(normalize_std=self.cfg.normalize_std)

        def scored(scores) -> None:  # every group's scores are back (gyre.real.verify): the step is enqueued
            batch, rewards, signal = [], [], 0
            for g, outs in zip(groups, scores):
                rewards += [o.reward for o in outs if o.outcome in MEMBER_OUTCOMES]
                adv = group_advantages(outs, adv_cfg)  # NaN: the execution left training (gyre.trajectory.credit)
                signal += bool(np.any(np.isfinite(adv) & (adv != 0)))
                gone = np.flatnonzero(np.isnan(adv))
                if gone.size:
                    self._log(("note", self.now, "group_left", {"group": g.id, "executions": gone.tolist(),
                                                                "whole": bool(gone.size == adv.size)}))
                batch.append((g.env.recorder.tree.preorder(), adv))
            self._log(("note", self.now, "train_batch", {"version": v + 1, "groups": [g.id for g in groups]}))
            t0 = self.now

            def end(stats) -> None:
                self.profile["train"].append((stats["tokens"], self.now - t0, stats["train_s"]))
                self._step_done(gpus, stats["tokens"], tuple(stats.get("trained_share", (1.0, 1.0))))
                self._serve_restarting()
                mean = float(np.mean(rewards)) if rewards else 0.0  # the members' rewards (none: every one left)
                self._log(("note", self.now, "train", {**stats, "reward_mean": mean,
                                                       "groups_with_signal": signal, "version": self._version}))
                self._deferred.append((h, self._version))

            self._enqueue_step(gpus, ray.put(batch), end)

        self.verifier.when(groups, scored)
        return h

    def _serve_restarting(self) -> None:
        """A step ended: restarting engines load the latest published version before they are ready again."""
        for e in self._engines.values():
            if e.state is RESTARTING:
                e.serve(self._published)

    def open_step(self, gpus: Sequence[int], groups: Sequence[RealGroup]) -> Handle:
        """A streaming step on `gpus` (the core cell) for `groups`, finished or not (gyre.real.streaming)."""
        gpus = self._check_open(gpus, groups)
        if self._steps:
            raise ClusterError(f"open_step: the train step making version {self._tv - self.base_version + 1} "
                               f"is still running")
        if self.pool.cfg.trainer_config.sharding != "dp":
            raise ClusterError(f"open_step: streaming steps train replicas (trainer sharding 'dp'), not "
                               f"{self.pool.cfg.trainer_config.sharding!r}")
        h = Handle(f"step{self._version}")
        self._step = RealStep(self, gpus, groups, h)
        return h

    def extend_step(self, groups: Sequence[RealGroup]) -> Handle:
        self._step.add(self._check_extend(groups))
        return done_handle(None, "extend_step")

    def join_step(self, gpus: Sequence[int]) -> Handle:
        return self._step.join(self._check_join(gpus))

    def leave_step(self, gpus: Sequence[int]) -> Handle:
        return self._step.leave(self._check_leave(gpus))

    def _sync_now(self, todo: list[RealEngine], v: int, h: Handle) -> Handle:
        t0, left = self.now, [len(todo)]

        def one(e: RealEngine):
            actor = e.actor

            def done(_dt, err) -> None:
                moot = err is not None and not e.ready and not isinstance(err, ray.exceptions.RayActorError)
                if moot:  # stopped while its load was in flight (the engine refused it asleep): it wakes with the latest
                    self._log(("note", self.now, "sync_moot", {"engine": e.id, "version": v, "error": str(err)[:200]}))
                elif err is not None and not isinstance(err, ray.exceptions.RayActorError):
                    raise err
                elif err is not None:  # it died: its replacement wakes with (or catches up to) the latest
                    self._on_engine_dead(e, actor)
                else:
                    e.serve(max(e.version, v))
                    self._log(("sync", self.now, e.id, v))
                left[0] -= 1
                if left[0] == 0:
                    self.profile["sync"].append(self.now - t0)
                    self._deferred.append((h, None))
            return done

        fault = self.injector.take_sync_fault(self, todo)
        if fault is not None and fault[0] == "delay":
            self._call_after(fault[1], lambda: self._publish_each(todo, one, None))
        else:
            self._publish_each(todo, one, fault[1] if fault is not None else None)
        return h

    def _succeed_after(self, seconds: float, h: Handle) -> None:
        self._call_after(seconds, lambda: self._deferred.append((h, None)))

    def _call_after(self, seconds: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (self.now + seconds, self._seq, fn))

    # ------------------------------------------------------------------ fault injection
    def step_in_flight(self) -> tuple[int, ...]:
        """The GPUs of the training step running now (empty: none); a streaming step's: its cells'."""
        if self._step is not None:
            return self._step.gpus()
        return self._steps[0][0] if self._stepping else ()

    def worker_of_record(self) -> int | None:
        """The trainer worker holding the latest state (None: it is being rebuilt)."""
        return self._record

    # ------------------------------------------------------------------ running
    def run(self, policy, steps: int, on_tick: Callable[[RealCluster], None] | None = None,
            on_start: Callable[[RealCluster], None] | None = None) -> Process:
        """Run `policy` until it returns; raise its error, a deadlock or a wall-clock overrun. `on_start` is
        called once the policy has set itself up (it waits on its first handle), before the loop turns."""
        proc = Process(policy.run(self, steps), label=getattr(policy, "name", "policy"))
        if on_start is not None:
            on_start(self)
        if self._estimate is not None:  # what the policy may read, in the run's log
            prof = {} if self.estimate_profile_s is None else {"profile_s": self.estimate_profile_s}
            self.note("cost_estimate", **self._estimate.as_dict(), source=self._estimate.source, **prof)
        self.injector.start(steps * self.cfg.groups_per_step * self.cfg.group_size)
        self._release_deferred()
        while not proc.done:
            while self._timers and self._timers[0][0] <= self.now:
                heapq.heappop(self._timers)[2]()
            self._release_deferred()
            self.injector.tick(self)
            self._release_deferred()
            if proc.done:
                break
            if on_tick is not None:
                on_tick(self)
                self._release_deferred()
            if not self._pending and not self._timers:
                raise ClusterError(f"deadlock at t={self.now:.1f}s: the policy waits on nothing")
            if self.now > self.cfg.max_wall_s:
                raise ClusterError(f"run exceeded max_wall_s={self.cfg.max_wall_s}s at version {self._version}")
            wait = 0.1 if not self._timers else min(0.1, max(0.0, self._timers[0][0] - self.now))
            refs = list(self._pending)
            if not refs:
                time.sleep(wait)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in sorted(ready, key=lambda r: self._pending[r][0]):
                _, fn = self._pending.pop(ref)
                try:
                    val, err = ray.get(ref), None
                except ray.exceptions.RayError as exc:
                    val, err = None, exc
                fn(val, err)
                self._release_deferred()
        if proc.error is not None:
            raise proc.error
        return proc

    def close(self) -> dict:
        """Put engines still up to sleep (the pool is reused) and collect the engines' profiles."""
        for ref in [e.actor.sleep.remote() for e in self._engines.values() if e.ready and not e.members]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # killed and not yet noticed: the pool replaces it below
        try:
            ray.get(self._background)
        except ray.exceptions.RayError:
            pass  # a release sent to an engine that was killed
        self._background = []
        self.pool.heal()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        profs = ray.get([a.get_profile.remote() for a in self.pool._engines.values()])
        for key in ("prefill", "decode", "load"):
            self.profile["engine_" + key] = [r for p in profs for r in p[key]]
        return self.profile

