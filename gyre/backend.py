"""The skeleton every backend shares: observations, verb preconditions, booking records, handle release.

A backend (gyre.sim.cluster.backend.SimCluster, gyre.real.backend.RealCluster) subclasses `ClusterBase` and adds
only what differs: how time passes (`now`, `_succeed_after`), what an engine and an execution are, and how
each verb's work is carried out. Everything a policy observes, every precondition a verb checks, and every
record the shared event log gets for a group, an engine coming up or going down, a training step and a
policy note is written here once, so the two backends cannot drift apart.

Handle completions caused by a backend's own events go to `_deferred` and are released by `_release_deferred`, after
the event is fully booked: a policy never observes an engine half-way through an update.

Both backends' engines are `gyre.engine_lifecycle.EngineLifecycle`s; which of its states each verb accepts is
decided here (`LISTED`, `ACCEPTING`, `STOPPABLE`).

Assumes the subclass sets, before use: `_engines` (id -> EngineLifecycle with `.gpus`, `.members`),
`executions` (id -> execution with `.engine`, `.phase`, `.started_at`, `.migrate_to`), `groups`, `log`,
`gpu_roles` (gyre.gpu_roles.GpuRoles), `_version` (steps done in this run) and `_next_engine`; `init_books` sets
them all.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

from gyre.cluster import ClusterError, EngineView, ExecutionView, Group, Phase, Role
from gyre.handles import Handle, Process, done_handle
from gyre.engine_lifecycle import READY, RESTARTING, STARTING, STOPPED
from gyre.gpu_roles import TRAINER, GpuRoles


class _Park:
    """The target of a park: a migration to no engine."""

    id = None

    def __repr__(self) -> str:
        return "PARK"


PARK = _Park()


def share_of(tokens: float, attn: float, exact_tokens: float, exact_attn: float) -> tuple[float, float]:
    """A step's `trained_share`: trained over exact (tokens, attention); a zero exact count gives 1.0."""
    return (tokens / exact_tokens if exact_tokens > 0 else 1.0, attn / exact_attn if exact_attn > 0 else 1.0)


class BookedGroup:
    """What both backends' groups share: a group is done once each of its `executions` is."""

    __slots__ = ()

    @property
    def done(self) -> bool:
        return all(e.phase == Phase.DONE for e in self.executions)


class BookedExecution:
    """The ExecutionView's `engine_id`: the id of the `engine` an execution is on (the real backend's; the
    simulator's SimExecution, a C type in the compiled build (gyre.compiled), states it itself)."""

    __slots__ = ()

    @property
    def engine_id(self) -> int | None:
        return None if self.engine is None else self.engine.id


class BookedStep:
    """The StepView both backends' streaming steps share (gyre.sim.cluster.streaming.SimStep,
    gyre.real.streaming.RealStep), read from their `_version`, `_groups`, `_cells` (each with `.gpus`, the core
    first), micro-step `queue`, `_untrained` count and end handle `h`."""

    __slots__ = ()

    @property
    def version(self) -> int:
        return self._version

    @property
    def groups(self) -> Sequence[Group]:
        return self._groups

    @property
    def cells(self) -> list[tuple[int, ...]]:
        return [x.gpus for x in self._cells]

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def n_untrained(self) -> int:
        return self._untrained

    @property
    def done(self) -> bool:
        return self.h.done


class ClusterBase:
    LISTED = (STARTING, READY, RESTARTING)  # engine states engines() reports
    ACCEPTING = (READY, RESTARTING)  # engine states admit() accepts (a restarting engine's wait for it)
    STOPPABLE = (READY, RESTARTING)  # engine states stop_engine() accepts (carried out once it is back)

    def init_books(self, n_gpus: int, *, gpus_per_engine: int, min_train_gpus: int, groups_per_step: int,
                   cell_gpus: int = 0, standalone_gpus: int = 0, steps_per_burst: int = 1) -> None:
        """The driver-side bookkeeping both backends keep: engines, groups, executions, GPU roles, the log; and
        the cluster's shape (GPUs per engine, the fewest GPUs a step trains on, groups per step, the training
        cells' size (0: `min_train_gpus`), the standalone rollout pool's GPUs, steps per weight publication)."""
        self._shape = (gpus_per_engine, min_train_gpus, groups_per_step)
        self._cell_gpus = cell_gpus or min_train_gpus
        self._standalone = standalone_gpus
        self._mu = steps_per_burst
        self._engines: dict[int, Any] = {}
        self._next_engine = 0
        self._version = 0
        self._published = 0  # the latest version engines may serve: a multiple of steps_per_burst
        self._trained_share = (1.0, 1.0)  # the latest finished step's trained over exact (tokens, attention)
        self._step: Any = None  # the open streaming step (a backend's StepView), if any
        self._deferred: list[tuple[Handle, Any]] = []
        self.log: list[tuple] = []
        self.gpu_roles = GpuRoles(n_gpus, self.log)
        self.groups: dict[int, Any] = {}
        self.executions: dict[int, Any] = {}

    # ------------------------------------------------------------------ observations
    @property
    def now(self) -> float:
        raise NotImplementedError

    @property
    def n_gpus(self) -> int:
        return self.gpu_roles.n

    @property
    def gpus_per_engine(self) -> int:
        return self._shape[0]

    @property
    def min_train_gpus(self) -> int:
        return self._shape[1]

    @property
    def groups_per_step(self) -> int:
        return self._shape[2]

    @property
    def version(self) -> int:
        return self._version

    @property
    def published_version(self) -> int:
        return self._published

    @property
    def steps_per_burst(self) -> int:
        return self._mu

    @property
    def cell_gpus(self) -> int:
        return self._cell_gpus

    @property
    def standalone_gpus(self) -> int:
        return self._standalone

    def cells(self) -> list[tuple[int, ...]]:
        c, n = self._cell_gpus, self.n_gpus - self._standalone
        return [tuple(range(i, i + c)) for i in range(0, n - c + 1, c)]

    @property
    def training(self):
        return self._step

    @property
    def trained_share(self) -> tuple[float, float]:
        """(tokens, attention-context sum) the latest finished training step trained, each over what exact
        training (every path of every tree) of the same batch would have; (1.0, 1.0) before any step and
        whenever every path trains."""
        return self._trained_share

    def role(self, gpu: int) -> Role:
        return self.gpu_roles.role[gpu]

    def free_gpus(self) -> list[int]:
        return self.gpu_roles.free()

    def engines(self) -> list[EngineView]:
        return [e for e in self._engines.values() if e.state in self.LISTED]

    def live(self) -> list[ExecutionView]:
        return [x for e in self._engines.values() for x in e.members.values()]

    def parked(self) -> list[ExecutionView]:
        return [x for x in self.executions.values() if x.phase == Phase.PARKED]

    # ------------------------------------------------------------------ preconditions
    def _check_start(self, gpus: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """(the GPUs, checked free and as many as an engine takes; the new engine's id)."""
        gpus = self.gpu_roles.check_free(gpus, "start_engine")
        if len(gpus) != self.gpus_per_engine:
            raise ClusterError(f"start_engine: an engine needs {self.gpus_per_engine} GPUs, got {len(gpus)}")
        self._next_engine += 1
        return gpus, self._next_engine - 1

    def _check_stop(self, engine) -> Any:
        eng = self._engines.get(engine.id)
        if eng is None or eng.state not in self.STOPPABLE:
            raise ClusterError(f"stop_engine: engine {engine.id} is not running")
        if eng.members:
            raise ClusterError(f"stop_engine: engine {eng.id} still holds {len(eng.members)} executions")
        return eng

    def _check_admit(self, execution, engine) -> tuple[Any, Any]:
        ex = self.executions.get(execution.id)
        eng = self._engines.get(engine.id)
        if ex is None or ex.engine is not None or ex.phase != Phase.QUEUED or ex.started_at is not None:
            raise ClusterError(f"admit: execution {execution.id} is not a fresh execution")
        if eng is None or eng.state not in self.ACCEPTING:
            raise ClusterError(f"admit: engine {engine.id} is not ready")
        return ex, eng

    def _check_migrate(self, execution, engine) -> tuple[Any, Any]:
        ex = self.executions.get(execution.id)
        dst = self._engines.get(engine.id)
        if ex is None or ex.engine is None:
            raise ClusterError(f"migrate: execution {execution.id} is not live on an engine")
        if dst is None or dst.state is not READY:
            raise ClusterError(f"migrate: target engine {engine.id} is not ready")
        if ex.migrate_to is not None:
            raise ClusterError(f"migrate: execution {ex.id} already has a migration pending")
        return ex, dst

    def _check_train(self, gpus: Sequence[int], groups: Sequence) -> tuple[int, ...]:
        gpus = self.gpu_roles.check_free(gpus, "train")
        if len(gpus) < self.min_train_gpus:
            raise ClusterError(f"train: the model needs >= {self.min_train_gpus} GPUs to train, got {len(gpus)}")
        if not groups:
            raise ClusterError("train: empty batch")
        for g in groups:
            if not g.done:
                raise ClusterError(f"train: group {g.id} has unfinished executions")
        return gpus

    def _check_open(self, gpus: Sequence[int], groups: Sequence) -> tuple[int, ...]:
        """An open_step's cell and batch: free GPUs, at least min_train_gpus; groups of this run, untrained, no
        group twice; no other step open (one version moves at a time)."""
        if self._step is not None:
            raise ClusterError(f"open_step: the step training version {self._step.version} is still open")
        gpus = self._check_cell(gpus, "open_step")
        if not groups:
            raise ClusterError("open_step: empty batch")
        ids = [g.id for g in groups]
        if len(set(ids)) != len(ids):
            raise ClusterError(f"open_step: a group appears twice in the batch {ids}")
        for g in groups:
            if self.groups.get(g.id) is not g:
                raise ClusterError(f"open_step: group {g.id} is not a group of this run")
        return gpus

    def _check_extend(self, groups: Sequence) -> list:
        step = self._step
        if step is None or step.ending:
            raise ClusterError("extend_step: no streaming step is open (or it is reducing)")
        have = {g.id for g in step.groups}
        for g in groups:
            if self.groups.get(g.id) is not g:
                raise ClusterError(f"extend_step: group {g.id} is not a group of this run")
            if g.id in have:
                raise ClusterError(f"extend_step: group {g.id} is in the batch already")
            have.add(g.id)
        if len(have) > self.groups_per_step:
            raise ClusterError(f"extend_step: the batch would hold {len(have)} groups, more than groups_per_step="
                               f"{self.groups_per_step}")
        return list(groups)

    def _check_cell(self, gpus: Sequence[int], what: str) -> tuple[int, ...]:
        gpus = self.gpu_roles.check_free(gpus, what)
        if len(gpus) < self.min_train_gpus:
            raise ClusterError(f"{what}: a cell needs >= {self.min_train_gpus} GPUs to hold the training state, "
                               f"got {len(gpus)}")
        return gpus

    def _check_join(self, gpus: Sequence[int]) -> tuple[int, ...]:
        if self._step is None or self._step.ending:
            raise ClusterError("join_step: no streaming step is open (or it is reducing)")
        return self._check_cell(gpus, "join_step")

    def _check_leave(self, gpus: Sequence[int]):
        """The satellite cell these GPUs form in the open step (the core cannot leave: it holds the optimizer)."""
        step = self._step
        cell = tuple(int(g) for g in gpus)
        if step is None or step.ending:
            raise ClusterError("leave_step: no streaming step is open (or it is reducing)")
        cells = step.cells
        if cell not in cells:
            raise ClusterError(f"leave_step: {cell} is not a cell of the open step (cells: {cells})")
        if cell == cells[0]:
            raise ClusterError("leave_step: the core cell holds the optimizer state and cannot leave its step")
        return cell

    @staticmethod
    def _check_sync(engines: Sequence) -> None:
        for e in engines:
            if e.state is not READY:
                raise ClusterError(f"sync: engine {e.id} is not ready")

    # ------------------------------------------------------------------ booking
    def _log(self, rec: tuple) -> None:
        self.log.append(rec)

    def _book_group(self, grp) -> None:
        self.groups[grp.id] = grp
        for ex in grp.executions:
            self.executions[ex.id] = ex
        self._log(("group", self.now, grp.id, len(grp.executions)))

    def _place_engine(self, eng) -> None:
        """A new engine holds its GPUs, which switch until it is up."""
        self._engines[eng.id] = eng
        self.gpu_roles.hold(eng.gpus, eng.id)
        self.gpu_roles.set_role(eng.gpus, Role.SWITCHING, self.now)

    def _engine_up(self, eng) -> None:
        self.gpu_roles.set_role(eng.gpus, Role.ROLLOUT, self.now)
        self._log(("engine_up", self.now, eng.id, eng.gpus))

    def _engine_down(self, eng) -> None:
        eng.transition(STOPPED)
        self.gpu_roles.hold(eng.gpus, None)
        self.gpu_roles.set_role(eng.gpus, Role.IDLE, self.now)
        self._log(("engine_down", self.now, eng.id))
        del self._engines[eng.id]

    def _book_trained(self, groups: Sequence, v: int) -> None:
        """One "trained" record per execution of the batch: its staleness against version v (the lag of its
        oldest token), and the sum over its generated tokens of each one's lag (v - the version that generated
        it) with their count, from the execution's `vsum` (sum of generating versions) and `generated`."""
        now = self.now
        for g in groups:
            for e in g.executions:
                fv = e.first_version if e.first_version is not None else v
                self.log.append(("trained", now, e.id, g.id, v, v - fv, v * e.generated - e.vsum, e.generated))

    def _step_done(self, gpus: Sequence[int], tokens: int, share: tuple[float, float] = (1.0, 1.0)) -> None:
        """A training step ended: the version advances, its GPUs are free, and `share` (what it trained over
        exact training's, `trained_share`) is what the next one is observed by."""
        self._version += 1
        self._trained_share = share
        self._published = self._version - self._version % self._mu
        self.gpu_roles.hold(gpus, None)
        self.gpu_roles.set_role(gpus, Role.IDLE, self.now)
        self._log(("step", self.now, self._version, len(gpus), tokens))

    def _hold_for_training(self, gpus: Sequence[int]) -> None:
        self.gpu_roles.hold(gpus, TRAINER)

    # ------------------------------------------------------------------ shared verbs
    def stop_engine(self, engine: EngineView) -> Handle:
        eng = self._check_stop(engine)
        h = Handle(f"stop_engine{eng.id}")
        if eng.state is RESTARTING:
            self._stop_after_restart(eng, h)
        else:
            self._stop(eng, h)
        return h

    def sync(self, engines: Sequence[EngineView]) -> Handle:
        """Bring `engines` to the latest published version; those serving it already, and restarting ones (they
        come back with it), need nothing."""
        todo = [self._engines[e.id] for e in engines if e.id in self._engines and e.version < self._published]
        todo = [e for e in todo if e.state is not RESTARTING]
        if not todo:
            return done_handle(None, "sync")
        self._check_sync(todo)
        v = self._published
        return self._sync_now(todo, v, Handle(f"sync{v}"))

    def migrate(self, execution: ExecutionView, engine: EngineView) -> Handle:
        ex, dst = self._check_migrate(execution, engine)
        h = Handle(f"migrate{ex.id}")
        if dst is ex.engine:
            return h.succeed(False)
        ex.migrate_to, ex.migrate_handle = dst, h
        if self._at_boundary(ex):
            self._migrate_now(ex)
        return h

    def park(self, execution: ExecutionView) -> Handle:
        """Take a live execution off its engine at its next tool-call boundary (a migration to nowhere); at once
        where the backend moves at the request (`_at_boundary`): its request is then retried where it resumes."""
        ex = self.executions.get(execution.id)
        if ex is None or ex.engine is None:
            raise ClusterError(f"park: execution {execution.id} is not live on an engine")
        if ex.migrate_to is not None:
            raise ClusterError(f"park: execution {ex.id} already has a migration pending")
        h = Handle(f"park{ex.id}")
        ex.migrate_to, ex.migrate_handle = PARK, h
        if self._at_boundary(ex):
            self._migrate_now(ex)
        return h

    def resume(self, execution: ExecutionView, engine: EngineView) -> Handle:
        """A parked execution joins a ready engine, which re-prefills its context."""
        ex = self.executions.get(execution.id)
        dst = self._engines.get(engine.id)
        if ex is None or ex.phase != Phase.PARKED:
            raise ClusterError(f"resume: execution {execution.id} is not parked")
        if dst is None or dst.state is not READY:
            raise ClusterError(f"resume: engine {engine.id} is not ready")
        self._log(("resume", self.now, ex.id, dst.id))
        self._resume_now(ex, dst)
        return Handle(f"resume{ex.id}").succeed(True)

    def timeout(self, seconds: float) -> Handle:
        if seconds < 0 or math.isnan(seconds):
            raise ClusterError(f"timeout: bad delay {seconds}")
        h = Handle("timeout")
        self._succeed_after(seconds, h)
        return h

    def spawn(self, gen: Generator[Handle, Any, Any], label: str = "") -> Handle:
        return Process(gen, label or "process")

    def note(self, kind: str, **fields: Any) -> None:
        self._log(("note", self.now, kind, fields))

    def _release_deferred(self) -> None:
        """Release deferred handle completions (and those their waiters cause) until none is left."""
        while self._deferred:
            batch, self._deferred = self._deferred, []
            for h, v in batch:
                h.succeed(v)

    # ------------------------------------------------------------------ what each backend supplies
    def _succeed_after(self, seconds: float, h: Handle) -> None:
        """Complete `h` with None `seconds` from now."""
        raise NotImplementedError

    def _stop(self, eng, h: Handle) -> None:
        """Put a ready engine to sleep; `h` completes once it is down."""
        raise NotImplementedError

    def _stop_after_restart(self, eng, h: Handle) -> None:
        """A stop asked while `eng` restarts: carry it out (completing `h`) once it is back."""
        raise NotImplementedError

    def _sync_now(self, engines: list, version: int, h: Handle) -> Handle:
        """Load `version` on `engines` (ready, behind it); `h` (returned) completes once all serve it."""
        raise NotImplementedError

    def _at_boundary(self, ex) -> bool:
        """Whether a live execution may move now: it is not mid-segment, or the backend moves at the request
        (move_at="request": a decoding execution's in-flight request is cancelled and retried at the destination)."""
        raise NotImplementedError

    def _migrate_now(self, ex) -> None:
        """Carry out ex's pending migration (its `migrate_to` may be PARK: it leaves every engine)."""
        raise NotImplementedError

    def _resume_now(self, ex, engine) -> None:
        """Place a parked execution on `engine` (its context re-prefilled there)."""
        raise NotImplementedError
