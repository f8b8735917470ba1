"""A streaming training step on Ray: the real backend's StepView (gyre.cluster.StepView), the driver's side.

The semantics and the log records are the simulator's (its streaming step, docs/cluster-interface.md); what
differs is that the work runs on trainer workers (gyre.real.cell_worker) and takes the time it takes.

Micro-steps. A group of the batch becomes trainable once it has finished and its scores are back (the rewards
are computed off the driver, gyre.real.verify; its group-relative advantages need every score): one micro-step
per execution, its part of the group's tree (gyre.trajectory.Preorder.of_execution), in the recorder's order
(RealGroup.recorded_ids: the order the episodes started), queued in the order the groups were scored. Each cell
trains one micro-step at a time and takes the queue's head as it frees up, cells in join order (the core first).

A cell's life. A cell is the trainer workers of its GPUs. Open (the core) or join (a satellite): its GPUs switch
in (SWITCHING) while each worker loads the core's weight snapshot of the step's version (read once, at the
open, from the worker of record; a worker holding that version loads nothing) and zeroes its gradients; it
trains micro-steps (TRAIN), waiting for one IDLE and held by the step. A satellite asked to leave finishes its
running micro-step, hands its accumulated gradient over (kept in the object store for the core) and is free.
The step ends once every micro-step is trained and every hand-over is done: it joins the training queue of
gyre.real.train_step (so the core, if it does not hold the state of record, is sent it, and a lost state of
record is rebuilt first), the gradients are summed into the core, which steps the optimizer and publishes;
then the version moves and every cell's GPUs are free. A satellite still switching in then is dropped: its
join completes with False once its load ends.

A lost worker (its call fails, or a probe finds it dead): the cell it belongs to loses the gradient it
accumulated, so every micro-step the cell took goes back to the queue's head (a "cell_lost" note lists them;
they are trained again, and the log shows each one's "micro" records and the loss between them). A satellite
then leaves the step; the core (it holds the optimizer state) reloads the snapshot on its workers (the lost one
replaced, and the state of record rebuilt first if it held it: checkpoint and replay) and trains on. A satellite
asked to leave and lost before its gradient is handed over is lost alike; its leave completes once it is out. The
snapshot's worker lost before it is read: it is read again from the worker then holding the state (or rebuilt).

A worker lost during the final reduction (from its end's entry in the training queue until the reduction's calls
are back). The reduction stands if a rank of the core returned from it: its all-reduce received every member's
gradient, so its optimizer step is the whole batch's (the core's ranks that failed hold an unknown state).
Otherwise it is voided (a "reduction_void" note) and redone among the survivors, the simulator's semantics: each
worker reduced a copy of its gradient (gyre.real.cell_worker), so every surviving cell still holds what it
accumulated, and the left satellites' gradients are still to add; the lost worker's cell is lost as above (a
satellite's micro-steps back to the queue, retrained by the cells still in the step; the core reloads,
rebuilding the state of record first if it held it: checkpoint and replay), and the step ends again, with a
fresh group, once they are trained. A member lost before the group of a new membership has formed stalls the
others until the collective timeout (gyre.real.collective.CollectiveConfig.timeout_s); a group formed before
fails at once (gloo's peer closes).

Simplifications: one optimizer step per streaming step (gyre.real.cell_worker); a micro-step's "tokens" are its
packed tokens, as `train` reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from gyre.backend import BookedStep
from gyre.cluster import ClusterError, Role
from gyre.gpu_roles import TRAINER
from gyre.handles import Handle
from gyre.trajectory import AdvantageConfig, group_advantages

if TYPE_CHECKING:
    from gyre.real.backend import RealCluster


class _Cell:
    __slots__ = ("gpus", "ready", "busy", "trained", "leave", "role", "dead", "join")

    def __init__(self, gpus: tuple[int, ...], join: Handle | None) -> None:
        self.gpus = gpus
        self.ready = False  # its workers hold the snapshot: it takes micro-steps
        self.busy: tuple | None = None  # (micro-step, start time) of the one running
        self.trained: list[tuple] = []  # micro-steps whose gradients it holds
        self.leave: Handle | None = None  # a leave asked: carried out between micro-steps
        self.role: Role | None = None
        self.dead = False  # a worker was lost while a call of the cell was in flight
        self.join = join  # completed once it first trains (None: the core's open)


class RealStep(BookedStep):
    """One open streaming step (at most one per cluster): its batch, cells, micro-step queue and end."""

    def __init__(self, c: RealCluster, core: tuple[int, ...], groups: Sequence, h: Handle) -> None:
        self.c = c
        self._version = c.version
        self._tv = c._tv  # the trainer's version the step trains on (the workers count from the base version)
        self._groups = list(groups)
        self.h = h
        self._cells: list[_Cell] = []
        self.queue: deque[tuple[int, Any, float]] = deque()  # (execution id, its tree, its advantage)
        self._untrained = sum(len(g.executions) for g in self._groups)
        self._stats: dict[int, dict] = {}  # execution id -> its micro-step's stats, while its gradient stands
        self._trees: dict[int, tuple] = {}  # group id -> (its tree's preorder, advantages): the replay's batch
        self._rewards: dict[int, list[float]] = {}
        self._left: list = []  # object refs of the gradients of satellites that left
        self.sending = 0  # leaving satellites handing their gradients over
        self.ending = False  # reducing into the core: no join, no leave
        self._reducing: list[_Cell] = []  # the cells whose gradients the end reduces, the core first
        self._snapshot = None  # object ref of the core's weights of version _tv (read once the record is there)
        self._waiting: list[_Cell] = []  # cells waiting for the snapshot
        self._gps = c.groups_per_step
        c._log(("step_open", c.now, self._version, core, len(self._groups)))
        self._watch(self._groups)
        c._when_record(self._take_snapshot)
        self._add(core, None)

    def add(self, groups: list) -> None:
        """More groups join the batch (extend_step); the step ends only once it holds groups_per_step."""
        self._groups += groups
        self._untrained += sum(len(g.executions) for g in groups)
        self.c._log(("step_extend", self.c.now, self._version, tuple(g.id for g in groups)))
        self._watch(groups)

    def _watch(self, groups: list) -> None:
        adv_cfg = AdvantageConfig(normalize_std=self.c.cfg.normalize_std)
        for g in groups:
            self.c.verifier.on_scored(g, lambda outs, g=g: self._scored(g, outs, adv_cfg))

    def gpus(self) -> tuple[int, ...]:
        """Every GPU of a cell of the step (fault injection picks a rank among them)."""
        return tuple(g for x in self._cells for g in x.gpus)

    # ------------------------------------------------------------------ the batch
    def _scored(self, group, outs, adv_cfg: AdvantageConfig) -> None:
        adv = group_advantages(outs, adv_cfg)
        pre = group.env.recorder.tree.preorder()
        self._trees[group.id] = (pre, adv)
        self._rewards[group.id] = [o.reward for o in outs]
        self.queue.extend((x, pre.of_execution(i), float(adv[i])) for i, x in enumerate(group.recorded_ids()))
        self._dispatch()

    def _take_snapshot(self) -> None:
        c = self.c
        gpu = c._record
        actor = c.pool.trainers[gpu]
        ref, ack = actor.snapshot.remote()

        def taken(_n, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):  # the worker of record died: read them again once
                c._trainer_dead(gpu, actor)  # another worker holds the state, or it is rebuilt (_when_record)
                c._when_record(self._take_snapshot)
                return
            if err is not None:
                raise ClusterError(f"open_step: the weights of version {self._tv} could not be read: {err}")
            self._snapshot = ref  # (set once read: a cell never loads a snapshot that failed)
            waiting, self._waiting = self._waiting, []
            for cell in waiting:
                self._begin(cell)

        c._submit(ack, taken)

    # ------------------------------------------------------------------ cells
    def _set_role(self, cell: _Cell, role: Role) -> None:
        if cell.role is not role:
            cell.role = role
            self.c.gpu_roles.set_role(cell.gpus, role, self.c.now)

    def _add(self, gpus: tuple[int, ...], h: Handle | None) -> None:
        cell = _Cell(gpus, h)
        self._cells.append(cell)
        self.c.gpu_roles.hold(gpus, TRAINER)
        self._set_role(cell, Role.SWITCHING)
        self._waiting.append(cell)
        if self._snapshot is not None:
            self._waiting.remove(cell)
            self._begin(cell)

    def join(self, gpus: tuple[int, ...]) -> Handle:
        h = Handle(f"join{gpus[0]}")
        self._add(gpus, h)
        return h

    def _begin(self, cell: _Cell) -> None:
        """Each worker of the cell loads the snapshot (unless it holds the step's version) and zeroes its gradients."""
        c = self.c
        cell.ready, cell.dead = False, False
        self._set_role(cell, Role.SWITCHING)
        self._on_all(cell, [(g, "cell_begin", (self._tv, None if self._holds(g) else self._snapshot))
                            for g in cell.gpus], lambda _outs: self._up(cell))
        for g in cell.gpus:
            if not self._holds(g):
                c._held[g] = None  # the step's weights, another version's optimizer state

    def _holds(self, g: int) -> bool:
        c = self.c
        return c._held[g] == self._tv and c._shard_of[g] is None

    def _on_all(self, cell: _Cell, calls: list[tuple[int, str, tuple]], then) -> None:
        """Run one call on each of the listed workers of `cell`; `then(results by GPU)` once all are back, unless a
        worker was lost (the cell is lost then)."""
        c = self.c
        left, outs = [len(calls)], {}

        def one(g: int, actor):
            def done(out, err) -> None:
                if isinstance(err, ray.exceptions.RayActorError):
                    cell.dead = True
                    c._trainer_dead(g, actor)
                elif err is not None:
                    raise ClusterError(f"streaming step {self._version + 1}: worker {g} failed: {err}")
                outs[g] = out
                left[0] -= 1
                if left[0] == 0:
                    if cell.dead:
                        self._lose(cell)
                    else:
                        then(outs)
            return done

        for g, method, args in calls:
            actor = c.pool.trainers[g]
            c._submit(getattr(actor, method).remote(*args), one(g, actor))

    def _up(self, cell: _Cell) -> None:
        c = self.c
        if self.ending or self.done:  # the step ended while it loaded: it trains nothing
            self._cells.remove(cell)
            self._free(cell)
            if cell.join is not None:
                c._deferred.append((cell.join, False))
            if cell.leave is not None:
                c._deferred.append((cell.leave, None))
            return
        cell.ready = True
        c._log(("cell_join", c.now, self._version, cell.gpus))
        if cell.join is not None:
            c._deferred.append((cell.join, True))
            cell.join = None
        if cell.leave is not None:
            self._leave_now(cell)
        else:
            self._dispatch()
            self._maybe_end()

    def leave(self, gpus: tuple[int, ...]) -> Handle:
        cell = next(x for x in self._cells if x.gpus == gpus)
        if cell.leave is not None:
            raise ClusterError(f"leave_step: cell {gpus} is already leaving")
        h = Handle(f"leave{gpus[0]}")
        cell.leave = h
        if cell.ready and cell.busy is None:
            self._leave_now(cell)
        return h

    def _leave_now(self, cell: _Cell) -> None:
        """A satellite between micro-steps leaves: its gradients (if any) are handed over, then its GPUs are free."""
        c = self.c
        self._cells.remove(cell)
        self.sending += 1

        def gone() -> None:
            self.sending -= 1
            self._free(cell)
            c._deferred.append((cell.leave, None))
            self._dispatch()
            self._maybe_end()

        if not cell.trained:
            gone()
            return
        self._set_role(cell, Role.SWITCHING)
        left, refs = [len(cell.gpus)], []

        def one(g: int, actor):
            def done(_n, err) -> None:
                if isinstance(err, ray.exceptions.RayActorError):  # its gradient is lost with it
                    c._trainer_dead(g, actor)
                    cell.dead = True
                elif err is not None:
                    raise ClusterError(f"leave_step: worker {g} could not hand its gradient over: {err}")
                left[0] -= 1
                if left[0] == 0:
                    if cell.dead:
                        self._requeue(cell)
                    else:
                        self._left.extend(refs)
                    gone()
            return done

        for g in cell.gpus:
            actor = c.pool.trainers[g]
            grads, ack = actor.cell_grads.remote()
            refs.append(grads)
            c._submit(ack, one(g, actor))

    def _free(self, cell: _Cell) -> None:
        c = self.c
        c.gpu_roles.hold(cell.gpus, None)
        c.gpu_roles.set_role(cell.gpus, Role.IDLE, c.now)
        c._log(("cell_leave", c.now, self._version, cell.gpus))

    # ------------------------------------------------------------------ losing a worker
    def worker_lost(self, gpu: int) -> None:
        """Worker `gpu` died (gyre.real.train_step._trainer_dead): its cell, if idle, is lost now; a cell with a call
        in flight is lost once the call is back."""
        cell = next((x for x in self._cells if gpu in x.gpus), None)
        if cell is None or self.done:
            return
        if self.ending and cell in self._reducing:  # the reduction voids (or stands) once its calls are back
            cell.dead = True
            return
        if cell.ready and cell.busy is None:
            self._lose(cell)
        else:
            cell.dead = True

    def _requeue(self, cell: _Cell) -> None:
        """The cell's gradient is lost: every micro-step it took goes back to the queue's head, in its order."""
        back = list(cell.trained)
        if back:
            self.queue.extendleft(reversed(back))
            self._untrained += len(back)
            for ex_id, _, _ in back:
                self._stats.pop(ex_id, None)
        cell.trained = []
        self.c._log(("note", self.c.now, "cell_lost", {"version": self._version, "gpus": list(cell.gpus),
                                                       "micro": [m[0] for m in back]}))

    def _lose(self, cell: _Cell) -> None:
        c = self.c
        if cell.busy is not None:
            self.queue.appendleft(cell.busy[0])
            cell.busy = None
        self._requeue(cell)
        cell.ready = False
        if cell is self._cells[0]:  # the core keeps its place: its workers reload the snapshot
            self._set_role(cell, Role.SWITCHING)
            if self._snapshot is None:
                self._waiting.append(cell)
            else:
                c._when_record(lambda: self._begin(cell))
            return
        self._cells.remove(cell)
        self._free(cell)
        for h in (cell.join, cell.leave):
            if h is not None:
                c._deferred.append((h, False if h is cell.join else None))
        self._dispatch()
        self._maybe_end()

    # ------------------------------------------------------------------ micro-steps
    def _dispatch(self) -> None:
        for cell in self._cells:
            if not self.queue:
                break
            if cell.ready and cell.busy is None and cell.leave is None:
                self._start(cell)
        for cell in self._cells:
            if cell.ready and cell.busy is None:
                self._set_role(cell, Role.IDLE)

    def _start(self, cell: _Cell) -> None:
        c = self.c
        micro = self.queue.popleft()
        cell.busy = (micro, c.now)
        self._set_role(cell, Role.TRAIN)
        ex_id, tree, adv = micro
        ref, n = ray.put(tree), len(cell.gpus)
        self._on_all(cell, [(g, "micro", (ref, adv, r, n)) for r, g in enumerate(cell.gpus)],
                     lambda outs: self._end(cell, outs))

    def _end(self, cell: _Cell, outs: dict) -> None:
        c = self.c
        micro, t0 = cell.busy
        cell.busy = None
        cell.trained.append(micro)
        self._untrained -= 1
        first = outs[cell.gpus[0]]
        self._stats[micro[0]] = {"rows": first["rows"], "tokens": first["tokens"],
                                 "loss": sum(o["loss"] for o in outs.values()),
                                 "mismatch": np.sum([o["mismatch"] for o in outs.values()], axis=0)}
        c.profile.setdefault("micro", []).append((first["tokens"], c.now - t0, len(cell.gpus)))
        c._log(("micro", c.now, self._version, micro[0], t0, cell.gpus[0], first["tokens"]))
        if cell.leave is not None:
            self._leave_now(cell)
        self._dispatch()
        self._maybe_end()

    # ------------------------------------------------------------------ the end
    def _maybe_end(self) -> None:
        if self.ending or self._untrained or self.sending or len(self._groups) < self._gps \
                or any(x.busy for x in self._cells):
            return
        if not self._cells[0].ready:  # the core reloads after a loss: it ends once back
            return
        self.ending = True
        c = self.c
        core = self._cells[0]
        self._reducing = [core] + [x for x in self._cells[1:] if x.ready and x.trained]
        for x in self._reducing:
            self._set_role(x, Role.TRAIN)
        batch = ray.put([self._trees[g.id] for g in self._groups])
        c._steps.append((core.gpus, _End(self, batch), self._booked))
        c._next_step()

    def launch(self, state, stale: set[int], save: str | None, batch) -> None:
        """The reduction into the core and its optimizer step (called by gyre.real.train_step once the core may get
        the state of record: `state`, for its workers in `stale`)."""
        c = self.c
        members = tuple(g for x in self._reducing for g in x.gpus)
        if any(x.dead for x in self._reducing):  # a worker was lost while the end waited in the queue
            self._void(members)
            return
        n_core = len(self._reducing[0].gpus)
        specs = c.pool.book.specs(tuple(f"t{g}" for g in members), "dp") if len(members) > 1 else [None]
        st = list(self._stats.values())
        if c.pool.cfg.trainer_config.normalization == "token":
            divisor = sum(s["rows"] for s in st)
        else:
            divisor = sum(1 for s in st if s["rows"] > 0)
        left, outs, errors = [len(members)], {}, []
        faults_before = c._trainer_faults

        def one(rank: int, actor):
            def done(out, err) -> None:
                g = members[rank]
                if isinstance(err, ray.exceptions.RayActorError):
                    c._trainer_dead(g, actor)  # its cell is marked dead (worker_lost)
                if err is not None:
                    errors.append(f"rank {rank} (GPU {g}): {str(err).splitlines()[0][:160]}")
                else:
                    outs[rank] = out
                left[0] -= 1
                if left[0] == 0:
                    stepped = [r for r in range(n_core) if r in outs]
                    if stepped:  # the core stepped on every member's gradient: the step stands
                        if errors:
                            c.pool.book.broken("dp", tuple(f"t{g}" for g in members))
                            c._log(("note", c.now, "step_partial", {"version": self._version + 1, "errors": errors}))
                        # its ranks lost since hold nothing (none left: the state is rebuilt, this batch replayed)
                        live = tuple(members[r] for r in stepped if c.pool.trainers[members[r]] is ranks[r])
                        self._reduced(live, members[stepped[0]], outs[stepped[0]], st,
                                      save if 0 in stepped else None, batch)  # (rank 0 writes it)
                    elif any(x.dead for x in self._reducing) or c._trainer_faults != faults_before:
                        self._void(members, errors)  # (a rank may fail for a worker lost elsewhere: worker 0's store)
                    else:
                        raise ClusterError(f"streaming step {self._version + 1}: the reduction into the core "
                                           f"failed: {'; '.join(errors) or 'no rank of the core returned'}")
            return done

        ranks = [c.pool.trainers[g] for g in members]
        for rank, (g, spec) in enumerate(zip(members, specs)):
            core = rank < n_core
            args = (spec, core, float(max(divisor, 1)), save if rank == 0 else None,
                    state if core and g in stale else None, *(self._left if rank == 0 else ()))
            c._submit(ranks[rank].cell_end.remote(*args), one(rank, ranks[rank]))

    def _void(self, members: tuple[int, ...], errors: Sequence[str] = ()) -> None:
        """The reduction failed on every rank of the core: nothing was applied. Its entry leaves the training queue,
        the cells whose worker was lost are lost (their micro-steps back to the queue), and the step ends again once
        they are trained, among the cells still in it (their gradients, and the left satellites', are intact)."""
        c = self.c
        if len(members) > 1:
            c.pool.book.broken("dp", tuple(f"t{g}" for g in members))
        entry = c._steps.popleft()
        assert isinstance(entry[1], _End) and entry[1].step is self, "the training queue's head is not this end"
        c._stepping = False
        self.ending = False
        lost, self._reducing = [x for x in self._reducing if x.dead], []
        c._log(("note", c.now, "reduction_void", {"version": self._version, "lost": [list(x.gpus) for x in lost],
                                                  "errors": list(errors)}))
        for cell in lost:
            self._lose(cell)
        self._dispatch()
        self._maybe_end()
        c._next_step()

    def _reduced(self, live: tuple[int, ...], first: int, out: dict, st: list[dict], save: str | None,
                 batch) -> None:
        tokens = sum(s["tokens"] for s in st)
        rows = sum(s["rows"] for s in st)
        mm = np.sum([s["mismatch"] for s in st], axis=0) if st else np.zeros(2)
        div = rows if self.c.pool.cfg.trainer_config.normalization == "token" else sum(1 for s in st if s["rows"] > 0)
        stats = {**out, "loss": sum(s["loss"] for s in st) / max(div, 1), "tokens": tokens, "rows": rows,
                 "logp_mismatch": float(mm[0] / mm[1]) if mm[1] > 0 else 0.0, "epochs": 1, "drift": 0.0,
                 "cells": len(self._reducing), "micro_steps": len(st)}
        self.c._stream_ended(live, first, stats, save, batch)

    def _booked(self, stats: dict) -> None:
        """The new version is published: book the step and free every cell in it."""
        c = self.c
        ready = [x for x in self._cells if x.ready]
        gpus = tuple(g for x in ready for g in x.gpus)
        self._cells = [x for x in self._cells if not x.ready]  # those switching in are dropped when up
        c._book_trained(self._groups, self._version)
        c._step = None
        c._step_done(gpus, stats["tokens"])
        c._serve_restarting()
        rewards = [r for g in self._groups for r in self._rewards[g.id]]
        signal = sum(bool(np.any(self._trees[g.id][1] != 0)) for g in self._groups)
        c._log(("note", c.now, "train", {**stats, "reward_mean": float(np.mean(rewards)),
                                         "groups_with_signal": signal, "version": c.version}))
        c._deferred.append((self.h, c.version))


class _End:
    """The end of a streaming step as an entry of gyre.real.train_step's queue (its `launch` runs it)."""

    def __init__(self, step: RealStep, batch) -> None:
        self.step, self.batch = step, batch

    def launch(self, state, stale: set[int], save: str | None) -> None:
        self.step.launch(state, stale, save, self.batch)
