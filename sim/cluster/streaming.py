"""A streaming training step in simulated time: the simulator's StepView (gyre.cluster.StepView).

Micro-steps. A batch's group (given at open, or added by extend_step
until the batch holds groups_per_step) becomes trainable when its last execution ends: one micro-step per execution, its
produced trajectory (a deadline cut trains what it produced), the group's shared prompt carried by its first
execution's micro-step. A micro-step costs Costs.train_time(tokens, cell GPUs, attention context), which is
linear in both, so a group's micro-steps on one cell cost what `train` charges the group. Micro-steps queue in
the order their groups finish (a group's executions in id order); each cell trains one at a time and takes the
queue's head as it frees up, cells in join order at equal times (the core first).

A cell's life. Open (the core) or join (a satellite): its GPUs switch in (a trainer onload unless their memory
holds the trainer), and a satellite then pulls the core's weight snapshot (Costs.snapshot_pull_s): weights are
fixed for the whole step, so every joiner reads the same snapshot. It trains micro-steps; waiting for one, its
GPUs are IDLE, held by the step. A satellite asked to leave finishes its running micro-step, sends the gradients
it accumulated to the core (Costs.grad_send_s) and is free. The step ends once every micro-step is trained and
every send has arrived: the gradients of the satellites still in it that trained are reduced into the core
(Costs.grad_reduce_s; a lone core reduces nothing), which steps the optimizer; then the version moves and every
cell's GPUs are free, their memory holding the trainer. A satellite still switching in then is dropped: its join
completes with False once its switch ends, and it trains nothing.

A lost trainer worker (gyre.sim.cluster.faults, the real backend's semantics: SimStep.worker_lost). Its cell's
gradient is lost: the micro-steps it trained in this step and the one it runs go back to the queue's head, the
other cells train on. A satellite is out of the step, its GPUs switching until the worker is back (as a voided
`train` attempt's), then free; the step does not end before. The core keeps its place and trains on once its
workers are back and the state of record is (rebuilt if lost). A kill during the reduction voids it (a
"reduction_void" note); the step ends once the lost micro-steps are trained again. Without faults no path changes.

Simplifications: a micro-step is one execution's whole trajectory (the packed tree Gyre trains as one sample);
the optimizer step is inside train_mfu, as in `train`; with role-bounded sampling (gyre.train_work) a
micro-step trains the paths `train` would draw for its group (the same draw) and costs their work; cells of unequal sizes reduce at the core's shard size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyre.backend import BookedStep, share_of
from gyre.cluster import Role
from gyre.gpu_roles import TRAINER
from gyre.handles import Handle
from gyre.hardware import train_attention_ctx

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster


def micro_steps(group, sampled=None) -> list[tuple[int, int, float]]:
    """A finished group's micro-steps: (execution id, trained tokens, attention context sum), the shared prompt
    (p tokens, p^2 / 2 context) on the first; they add up to what `train` charges the group. With role-bounded
    sampling, `sampled(group)` gives each execution's (tokens, attention) of the paths `train` would draw."""
    if sampled is not None:
        return [(ex.id, t, a) for ex, (t, a) in zip(group.executions, sampled(group))]
    out = []
    for i, ex in enumerate(group.executions):
        d = ex.produced()
        p = d.prompt
        own = d.tokens - p
        attn = train_attention_ctx(p, d.gen, d.kv, d.tool_out) - 0.5 * p * p
        out.append((ex.id, own + p, attn + 0.5 * p * p) if i == 0 else (ex.id, own, attn))
    return out


class _Cell:
    __slots__ = ("gpus", "ready", "busy", "trained", "leave", "role", "join", "epoch", "up_at")

    def __init__(self, gpus: tuple[int, ...], join: Handle | None) -> None:
        self.gpus = gpus
        self.ready = False  # switched in and holding the snapshot: it takes micro-steps
        self.busy: tuple | None = None  # (exec id, tokens, attention context, start, seconds) of its running micro-step
        self.trained: list[tuple] = []  # (exec id, tokens, attention context, roofline GPU-s): its gradient's micro-steps
        self.leave: Handle | None = None  # a leave asked: carried out between micro-steps
        self.role: Role | None = None
        self.join = join  # its join_step handle until it completes (None: the core)
        self.epoch = 0  # a fault bumps it: the cell's pending switch-in or micro-step end no longer counts
        self.up_at = 0.0  # when its switch-in ends


class SimStep(BookedStep):
    """One open streaming step (at most one per cluster): its batch, cells, micro-step queue and end."""

    def __init__(self, c: SimCluster, core: tuple[int, ...], groups: Sequence, h: Handle) -> None:
        self.c = c
        self._version = c.version
        self._groups = list(groups)
        self.h = h
        self._cells: list[_Cell] = []
        self.queue: deque[tuple[int, int, float]] = deque()
        self._untrained = sum(len(g.executions) for g in self._groups)
        self.sending = 0  # leaving satellites' gradients on their way to the core, lost satellites' restarts
        self.ending = False  # reducing into the core: no join, no leave
        self.tokens = 0  # tokens of the micro-steps whose gradients stand
        self.attn = 0.0  # their attention context
        self._end_epoch = 0  # a fault during the reduction bumps it: that reduction's end no longer counts
        self._rebuilding = False  # the end waits for the state of record to be rebuilt
        self._gps = c.groups_per_step
        self._sampled = c._sampled_each if c._sampling is not None else None
        c._log(("step_open", c.now, self._version, core, len(self._groups)))
        self._watch(self._groups)
        self._add(core, None)

    def add(self, groups: list) -> None:
        """More groups join the batch (extend_step)."""
        self._groups += groups
        self._untrained += sum(len(g.executions) for g in groups)
        self.c._log(("step_extend", self.c.now, self._version, tuple(g.id for g in groups)))
        self._watch(groups)
        self._dispatch()

    def _watch(self, groups: list) -> None:
        for g in groups:
            if g.done:
                self.queue.extend(micro_steps(g, self._sampled))
            else:
                queued = [False]
                for ex in g.executions:
                    ex.handle.on_done(lambda _h, g=g, queued=queued: self._finished(g, queued))

    def gpus(self) -> tuple[int, ...]:
        """Every GPU of a cell in the step, the core first (a kill-trainer fault picks a rank among them)."""
        return tuple(g for x in self._cells for g in x.gpus)

    # ------------------------------------------------------------------ cells
    def _set_role(self, cell: _Cell, role: Role) -> None:
        if cell.role is not role:
            cell.role = role
            self.c.gpu_roles.set_role(cell.gpus, role, self.c.now)

    def _add(self, gpus: tuple[int, ...], h: Handle | None) -> None:
        """A cell enters: once its trainer workers are up (after a fault: restarted, and for the core the state of
        record rebuilt if it was lost), its GPUs switch in and a satellite pulls the snapshot."""
        c = self.c
        cell = _Cell(gpus, h)
        self._cells.append(cell)
        c.gpu_roles.hold(gpus, TRAINER)
        core = h is None
        dt = c._switch_in_s(gpus, "trainer") + (0.0 if core else c.costs.snapshot_pull_s(len(gpus)))
        f = c._faults
        wait = f.trainer_ready_at(gpus, core) - c.now if f is not None else 0.0
        if dt + wait > 0:
            self._set_role(cell, Role.SWITCHING)
        cell.up_at = c.now + wait + dt
        e = cell.epoch

        def switch() -> None:
            if cell.epoch != e:
                return
            if dt > 0:
                c._after(dt, lambda: self._up(cell, e))
            else:
                self._up(cell, e)

        if wait > 0:
            c._after(wait, f.rebuilt_then(switch) if core else switch)
        else:
            switch()

    def _up(self, cell: _Cell, e: int) -> None:
        """The cell's switch-in (or the core's recovery) ended: it takes micro-steps, unless the step ended."""
        if cell.epoch != e:
            return
        c = self.c
        c.gpu_roles.load(cell.gpus, "trainer")
        if self.ending or self.done:  # the step ended while it switched in: it trains nothing
            self._cells.remove(cell)
            self._free(cell)
            if cell.join is not None:
                cell.join.succeed(False)
            return
        cell.ready = True
        c._log(("cell_join", c.now, self._version, cell.gpus))
        if cell.join is not None:
            h, cell.join = cell.join, None
            h.succeed(True)
        if cell.leave is not None:
            self._leave_now(cell)
        else:
            self._dispatch()
            self._maybe_end()

    def join(self, gpus: tuple[int, ...]) -> Handle:
        h = Handle(f"join{gpus[0]}")
        self._add(gpus, h)
        return h

    def leave(self, gpus: tuple[int, ...]) -> Handle:
        cell = next(x for x in self._cells if x.gpus == gpus)
        h = Handle(f"leave{gpus[0]}")
        if cell.leave is not None:
            from gyre.cluster import ClusterError

            raise ClusterError(f"leave_step: cell {gpus} is already leaving")
        cell.leave = h
        if cell.ready and cell.busy is None:
            self._leave_now(cell)
        return h

    def _leave_now(self, cell: _Cell) -> None:
        """A satellite between micro-steps leaves: its gradients (if any) go to the core, then its GPUs are free."""
        c = self.c
        self._cells.remove(cell)
        dt = c.costs.grad_send_s(len(cell.gpus)) if cell.trained else 0.0

        def gone() -> None:
            self.sending -= 1
            self._free(cell)
            cell.leave.succeed(None)
            self._maybe_end()

        self.sending += 1
        if dt > 0:
            self._set_role(cell, Role.SWITCHING)
            c._after(dt, gone)
        else:
            gone()

    def _free(self, cell: _Cell) -> None:
        c = self.c
        c.gpu_roles.hold(cell.gpus, None)
        c.gpu_roles.set_role(cell.gpus, Role.IDLE, c.now)
        c._log(("cell_leave", c.now, self._version, cell.gpus))

    # ------------------------------------------------------------------ losing a worker
    def worker_lost(self, gpu: int) -> None:
        """The trainer worker on `gpu`, a rank of this step's cell, died now (gyre.sim.cluster.faults.kill_trainer,
        which has marked it restarting and, if it held the state of record, handed that on or marked it lost).

        The cell loses the gradient it accumulated: its running micro-step and those it trained in this step go back
        to the queue's head, in the order it took them (a "cell_lost" note lists the trained ones), its pending
        events are void, and its GPUs switch (SWITCHING, held by the step) until the worker's replacement is up,
        as a voided `train` attempt's do. A satellite then leaves the step: once the worker is back its GPUs are
        free, its join (if pending) completes False and its leave (if asked) completes; the step does not end
        before (every GPU of the step is free when it ends). The core
        keeps its place (it holds the optimizer state): it is back once its workers are and, if the state of
        record was lost, rebuilt (checkpoint and replay), and trains on. A kill during the final reduction voids
        it (the reduction is a collective; the core's state is untouched, its optimizer step being inside the
        micro-steps' cost) and the step ends once the lost micro-steps are trained again."""
        cell = next((x for x in self._cells if gpu in x.gpus), None)
        if cell is None:
            return
        c, t = self.c, self.c.now
        f = c._faults
        if self.ending:
            self.ending = False
            self._end_epoch += 1
            c.note("reduction_void", version=self._version, lost=[list(cell.gpus)], errors=[])  # (the real one's)
        cell.epoch += 1
        if cell.busy is not None:
            ex_id, tokens, attn, _t0, _dt = cell.busy
            self.queue.appendleft((ex_id, tokens, attn))
            cell.busy = None
        back = cell.trained
        self.queue.extendleft((x, n, a) for x, n, a, _ in reversed(back))
        self._untrained += len(back)
        self.tokens -= sum(x[1] for x in back)
        self.attn -= sum(x[2] for x in back)
        c._roof_gpu_s -= sum(x[3] for x in back)
        cell.trained = []
        c.note("cell_lost", version=self._version, gpus=list(cell.gpus), micro=[x[0] for x in back])
        cell.ready = False
        self._set_role(cell, Role.SWITCHING)
        e = cell.epoch
        if cell is self._cells[0]:
            at = max(f.trainer_ready_at(cell.gpus, True), cell.up_at)
            c._after(at - t, f.rebuilt_then(lambda: self._up(cell, e)))
        else:
            self._cells.remove(cell)
            self.sending += 1

            def released() -> None:
                self.sending -= 1
                self._free(cell)
                if cell.join is not None:
                    h, cell.join = cell.join, None
                    h.succeed(False)
                if cell.leave is not None:
                    cell.leave.succeed(None)
                self._maybe_end()

            c._after(f.trainer_ready_at(cell.gpus, False) - t, released)
        self._dispatch()
        self._maybe_end()

    # ------------------------------------------------------------------ micro-steps
    def _finished(self, group, queued: list[bool]) -> None:
        if queued[0] or not group.done:
            return
        queued[0] = True
        self.queue.extend(micro_steps(group, self._sampled))
        self._dispatch()

    def _dispatch(self) -> None:
        for cell in self._cells:
            if not self.queue:
                break
            if cell.ready and cell.busy is None and cell.leave is None:
                self._start(cell)
        for cell in self._cells:
            if cell.ready and cell.busy is None and not (self._rebuilding and cell is self._cells[0]):
                self._set_role(cell, Role.IDLE)

    def _start(self, cell: _Cell) -> None:
        c = self.c
        ex_id, tokens, attn = self.queue.popleft()
        dt = c.costs.train_time(tokens, len(cell.gpus), attn)
        cell.busy = (ex_id, tokens, attn, c.now, dt)
        self._set_role(cell, Role.TRAIN)
        e = cell.epoch
        c._after(dt, lambda: self._end(cell, e))

    def _end(self, cell: _Cell, e: int) -> None:
        if cell.epoch != e:
            return
        c = self.c
        ex_id, tokens, attn, t0, dt = cell.busy
        cell.busy = None
        roof = dt * len(cell.gpus) * c.costs.train_mfu
        cell.trained.append((ex_id, tokens, attn, roof))
        self._untrained -= 1
        self.tokens += tokens
        self.attn += attn
        c._roof_gpu_s += roof
        c._log(("micro", c.now, self._version, ex_id, t0, cell.gpus[0], tokens))
        if cell.leave is not None:
            self._leave_now(cell)
        if self.queue:
            self._dispatch()
        elif cell.role is Role.TRAIN and cell.leave is None:
            self._set_role(cell, Role.IDLE)
        self._maybe_end()

    def _share(self) -> tuple[float, float]:
        """The step's trained_share: its micro-steps' work over the exact micro-steps' of the same groups."""
        if self._sampled is None:
            return (1.0, 1.0)
        exact = [m for g in self._groups for m in micro_steps(g)]
        return share_of(self.tokens, self.attn, sum(m[1] for m in exact), sum(m[2] for m in exact))

    def _maybe_end(self) -> None:
        if self.ending or self._untrained or self.sending or len(self._groups) < self._gps \
                or any(x.busy for x in self._cells):
            return
        core = self._cells[0]
        if not core.ready:  # the core recovers from a fault: the step ends once it is back
            return
        c = self.c
        f = c._faults
        if f is not None and f.record is None:  # the state of record was lost: the core gets it rebuilt first
            if not self._rebuilding:
                self._rebuilding = True
                self._set_role(core, Role.SWITCHING)

                def rebuilt() -> None:
                    self._rebuilding = False
                    self._maybe_end()

                c._after(f.trainer_ready_at(core.gpus, True) - c.now, f.rebuilt_then(rebuilt))
            return
        self.ending = True
        ready = [x for x in self._cells if x.ready]
        reducing = [core] + [x for x in ready[1:] if x.trained]
        dt = c.costs.grad_reduce_s(len(reducing), len(core.gpus))
        for x in reducing:
            self._set_role(x, Role.TRAIN)
        e = self._end_epoch

        def end() -> None:
            if e != self._end_epoch:
                return
            gpus = tuple(g for x in ready for g in x.gpus)
            self._cells = [x for x in self._cells if not x.ready]  # those switching in are dropped when up
            c.trained_groups.extend(g.id for g in self._groups)
            c._book_trained(self._groups, self._version)
            c._step = None
            c._step_done(gpus, self.tokens, self._share())
            if f is not None:  # the core's workers hold the new state; a rebuild replays the batch on the core
                f.step_ended(core.gpus, c.costs.train_time(self.tokens, len(core.gpus), self.attn))
            self.h.succeed(c.version)

        if dt > 0:
            c._after(dt, end)
        else:
            end()
