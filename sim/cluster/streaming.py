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

Simplifications: a micro-step is one execution's whole trajectory (the packed tree Gyre trains as one sample);
the optimizer step is inside train_mfu, as in `train`; cells of unequal sizes reduce at the core's shard size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyre.backend import BookedStep
from gyre.cluster import Role
from gyre.gpu_roles import TRAINER
from gyre.handles import Handle
from gyre.hardware import train_attention_ctx

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster


def micro_steps(group) -> list[tuple[int, int, float]]:
    """A finished group's micro-steps: (execution id, trained tokens, attention context sum), the shared prompt
    (p tokens, p^2 / 2 context) on the first; they add up to what `train` charges the group."""
    out = []
    for i, ex in enumerate(group.executions):
        d = ex.produced()
        p = d.prompt
        own = d.tokens - p
        attn = train_attention_ctx(p, d.gen, d.kv, d.tool_out) - 0.5 * p * p
        out.append((ex.id, own + p, attn + 0.5 * p * p) if i == 0 else (ex.id, own, attn))
    return out


class _Cell:
    __slots__ = ("gpus", "ready", "busy", "trained", "leave", "role")

    def __init__(self, gpus: tuple[int, ...]) -> None:
        self.gpus = gpus
        self.ready = False  # switched in and holding the snapshot: it takes micro-steps
        self.busy: tuple | None = None  # (exec id, tokens, start, seconds) of its running micro-step
        self.trained = 0  # micro-steps it trained
        self.leave: Handle | None = None  # a leave asked: carried out between micro-steps
        self.role: Role | None = None


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
        self.sending = 0  # leaving satellites' gradients on their way to the core
        self.ending = False  # reducing into the core: no join, no leave
        self.tokens = 0
        self._gps = c.groups_per_step
        c._log(("step_open", c.now, self._version, core, len(self._groups)))
        self._watch(self._groups)
        self._add(core, pull=False, h=None)

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
                self.queue.extend(micro_steps(g))
            else:
                queued = [False]
                for ex in g.executions:
                    ex.handle.on_done(lambda _h, g=g, queued=queued: self._finished(g, queued))

    # ------------------------------------------------------------------ cells
    def _set_role(self, cell: _Cell, role: Role) -> None:
        if cell.role is not role:
            cell.role = role
            self.c.gpu_roles.set_role(cell.gpus, role, self.c.now)

    def _add(self, gpus: tuple[int, ...], *, pull: bool, h: Handle | None) -> None:
        c = self.c
        cell = _Cell(gpus)
        self._cells.append(cell)
        c.gpu_roles.hold(gpus, TRAINER)
        dt = c._switch_in_s(gpus, "trainer") + (c.costs.snapshot_pull_s(len(gpus)) if pull else 0.0)
        if dt > 0:
            self._set_role(cell, Role.SWITCHING)

        def up() -> None:
            c.gpu_roles.load(gpus, "trainer")
            if self.ending or self.done:  # the step ended while it switched in: it trains nothing
                self._cells.remove(cell)
                self._free(cell)
                if h is not None:
                    h.succeed(False)
                return
            cell.ready = True
            c._log(("cell_join", c.now, self._version, gpus))
            if h is not None:
                h.succeed(True)
            if cell.leave is not None:
                self._leave_now(cell)
            else:
                self._dispatch()

        if dt > 0:
            c._after(dt, up)
        else:
            up()

    def join(self, gpus: tuple[int, ...]) -> Handle:
        h = Handle(f"join{gpus[0]}")
        self._add(gpus, pull=True, h=h)
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

    # ------------------------------------------------------------------ micro-steps
    def _finished(self, group, queued: list[bool]) -> None:
        if queued[0] or not group.done:
            return
        queued[0] = True
        self.queue.extend(micro_steps(group))
        self._dispatch()

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
        ex_id, tokens, attn = self.queue.popleft()
        dt = c.costs.train_time(tokens, len(cell.gpus), attn)
        cell.busy = (ex_id, tokens, c.now, dt)
        self._set_role(cell, Role.TRAIN)
        c._after(dt, lambda: self._end(cell))

    def _end(self, cell: _Cell) -> None:
        c = self.c
        ex_id, tokens, t0, dt = cell.busy
        cell.busy = None
        cell.trained += 1
        self._untrained -= 1
        self.tokens += tokens
        c._roof_gpu_s += dt * len(cell.gpus) * c.costs.train_mfu
        c._log(("micro", c.now, self._version, ex_id, t0, cell.gpus[0], tokens))
        if cell.leave is not None:
            self._leave_now(cell)
        if self.queue:
            self._dispatch()
        elif cell.role is Role.TRAIN and cell.leave is None:
            self._set_role(cell, Role.IDLE)
        self._maybe_end()

    def _maybe_end(self) -> None:
        if self.ending or self._untrained or self.sending or len(self._groups) < self._gps \
                or any(x.busy for x in self._cells):
            return
        self.ending = True
        c = self.c
        ready = [x for x in self._cells if x.ready]
        core = ready[0]
        reducing = [core] + [x for x in ready[1:] if x.trained]
        dt = c.costs.grad_reduce_s(len(reducing), len(core.gpus))
        for x in reducing:
            self._set_role(x, Role.TRAIN)

        def end() -> None:
            gpus = tuple(g for x in ready for g in x.gpus)
            self._cells = [x for x in self._cells if not x.ready]  # those switching in are dropped when up
            c.trained_groups.extend(g.id for g in self._groups)
            c._book_trained(self._groups, self._version)
            c._step = None
            c._step_done(gpus, self.tokens)
            self.h.succeed(c.version)

        if dt > 0:
            c._after(dt, end)
        else:
            end()
