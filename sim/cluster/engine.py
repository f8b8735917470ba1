"""A fluid model of one inference engine (vLLM-like continuous batching, chunked prefill) on k GPUs.

Every decoding sequence advances one token per engine step, so all share one virtual token clock V. A step
processes the n decodes and, within the token budget `max_batched_tokens`, a chunk of the prefill queue
(m = min(budget - n, pending) tokens at the head's offset); it takes `Costs.step_time(n, K, m, offset)` seconds
(gyre.roofline), so prefill slows the decodes it shares a step with. Between changes of membership the step
time is held constant (the fluid model: K and the head's offset are sampled at events): V advances at 1 / step
time and the prefill queue drains, head first, at m / step time tokens per second. Events happen only when a
segment ends, a tool returns, a prefill finishes, an execution is admitted, migrated or preempted, KV fills, or
weights sync; cost grows with executions and turns, never tokens.

An execution on an engine is in the wait queue (QUEUED), the prefill queue (PREFILL: its missing context is
being computed), the decode batch (DECODE) or a tool call (TOOL, a timer). Its next turn's context is `ctx`;
`resident` of it is in KV; the rest (the tool's output, or all of it after a preemption or a re-prefill
migration) must be prefilled here before it decodes.

KV memory is a hard limit: KV in use is the resident context of every member plus the growing contexts of the
decodes, plus, for a hybrid linear-attention model, one fixed state (`Costs.state_tokens`, in KV-token units)
per member that holds KV (decoding, or with a resident context: a cached context is resumable only with the
state at its end), and never exceeds capacity: when growth would fill it an event fires. The engine's parts:
its KvPressure (`pressure`, gyre.sim.cluster.kv_pressure) decides who starts from the wait queue and whose KV goes
when memory is short; its KvLedger (`kv`, gyre.sim.cluster.kv_ledger) alone writes the KV counters and each member's
resident context; gyre.sim.cluster.engine_moves is what the cluster does to it from outside (admissions, migrations,
a crash, a weight sync); gyre.engine_lifecycle.EngineLifecycle holds its state and served version. `admit_limit`
(gyre.hardware.admission_limit of the KV capacity and the workload's `max_context`) is reported to policies,
which hand the engine no more (policies.admit_queue); a larger context is an error (SimCluster.admit).

Costs without a roofline use the linear step a + b n + c K + prefill_s_per_token m (a zero prefill_s_per_token
makes prefill free, as in hand-built scenarios). A nonzero `Costs.request_s` (latency outside the engine) delays
each turn's request, on admission and after each tool call, as a timer (no KV beyond its resident context).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from gyre.engine_lifecycle import EngineLifecycle
from gyre.cluster import Phase
from gyre.hardware import admission_limit
from gyre.roofline_step import StepCost
from gyre.sim.cluster.kv_ledger import KvLedger
from gyre.sim.cluster.kv_pressure import KvPressure
from gyre.sim.cluster.time_heap import heappop, heappush

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster
    from gyre.sim.cluster.execution import SimExecution

_EPS = 1e-9
_INF = float("inf")
_PREFILL, _QUEUED = Phase.PREFILL, Phase.QUEUED


class SimEngine(EngineLifecycle):
    # slots: the wakeup reads and writes a few dozen attributes per event, and an instance dict of this many
    # keys would fall off CPython's fast attribute path
    __slots__ = (
        "cluster", "id", "gpus", "costs", "members", "queue", "batch", "timers", "prefill", "kv", "pressure",
        "_pf_due", "V", "t_last", "rate", "pf_rate", "paused", "epoch", "_budget", "_reserve", "kv_capacity",
        "_full", "_req", "_q", "_tick", "_fire", "_log", "kv_peak", "roof_s", "_roof", "_step2", "_seq", "_dirty",
        "admit_limit", "_finish",
    )

    def __init__(self, cluster: SimCluster, engine_id: int, gpus: tuple[int, ...], version: int) -> None:
        EngineLifecycle.__init__(self, version)
        self.cluster = cluster
        self.id = engine_id
        self.gpus = gpus
        c = self.costs = cluster.costs
        self.members: dict[int, SimExecution] = {}  # every execution it holds, any phase
        self.queue: deque[SimExecution] = deque()  # waiting for KV to start its prefill
        self.batch: list[tuple[float, int, SimExecution]] = []  # decoding, a heap: (target V, seq, execution)
        self.timers: list[tuple[float, int, SimExecution]] = []  # tool calls, a heap: (return time, seq, execution)
        self.prefill: deque[SimExecution] = deque()  # prefill queue; ex.pf_left tokens still to compute
        self.kv = KvLedger(c.state_tokens)  # the KV counters (module docstring)
        self.pressure = KvPressure(self)  # who starts, whose KV goes (module docstring)
        self._pf_due = _INF  # when the prefill head is planned to finish
        self.V = self.t_last = self.rate = self.pf_rate = 0.0  # token clock, its time, dV/dt, prefill tokens/s
        self.paused = self._dirty = False  # _dirty: a re-plan of the next wakeup is pending (touch)
        self.epoch = 0  # invalidates stale wakeups
        self._budget = c.max_batched_tokens
        self._reserve = c.kv_reserve
        self.kv_capacity: int = c.kv_capacity_tokens  # EngineView
        self._full = self.pressure.full  # KV tokens that count as full
        self._req = c.request_s
        self._q, self._tick = cluster.wakeups()
        self._finish = cluster.finish
        self._fire = self.fire
        self._log = cluster.log.append
        # the largest KV use; the integral of the roofline utilization (ideal / actual step time) over busy
        # time, and that share in the current plan
        self.kv_peak = self.roof_s = self._roof = 0.0
        # (step time, its ideal part at hardware peak) of a step: the roofline's, or the linear form's (no ideal)
        self._step2 = c.roofline.stepper() if c.roofline is not None else StepCost(linear=c.step_time)
        self._seq = itertools.count()
        self.admit_limit: int = admission_limit(c.kv_capacity_tokens, cluster.source.config.max_context,  # EngineView
                                                c.admission_fill, c.state_tokens)

    # --- EngineView (version, ready: EngineLifecycle) ---
    @property
    def n_live(self) -> int:
        return len(self.members)

    @property
    def n_decoding(self) -> int:
        return self.kv.n_dec

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def kv_used(self) -> float:
        return self.kv.used(self.V + (self.cluster.now - self.t_last) * self.rate)

    # --- fluid clock ---
    def advance(self, t: float) -> None:
        """Bring the token clock, the prefill queue's head and the roofline integral to time t."""
        dt = t - self.t_last
        if dt > 0.0:
            if self.rate:
                self.V += dt * self.rate
            if self.pf_rate:
                self.kv.prefill_progress(self.prefill[0], dt * self.pf_rate)
            self.roof_s += dt * self._roof
        self.t_last = t

    def replan_pending(self) -> None:
        """Plan the next wakeup if a change asked for it (touch); SimCluster runs this after each event."""
        if self._dirty:
            self._reschedule()

    def replan(self, t: float) -> None:
        """Plan the next wakeup now, at t (after a weight load starts or ends, or a crash)."""
        self.advance(t)
        self._reschedule()

    def _reschedule(self) -> None:
        """Plan this engine's next wakeup: a segment end, a tool return, the prefill head's end or KV full."""
        self._dirty = False
        self.epoch = ep = self.epoch + 1
        kv = self.kv
        n = kv.n_dec
        ready = self.timers
        wake = ready[0][0] if ready else _INF
        dec = kv.kv_dec_base + n * self.V  # decode context
        used = kv.mem_fixed + dec + (kv.st * kv.holders if kv.st else 0.0)
        if used > self.kv_peak:
            self.kv_peak = used
        pf = self.prefill
        pend = kv.pf_pending if pf else 0.0  # an empty queue's float residue is 0
        if self.paused or (n == 0 and pend <= 0.0):
            self.rate = self.pf_rate = self._roof = 0.0
            self._pf_due = _INF
        else:
            tl = self.t_last
            budget = self._budget
            if pend > 0.0 and n < budget:
                m = budget - n
                if pend < m:
                    m = pend
                head = pf[0]
                left = head.pf_left
                step, ideal = self._step2.both(n, dec, m, head.resident - left)
                self.pf_rate = m / step
                t_pf = self._pf_due = tl + left * step / m
                if t_pf < wake:
                    wake = t_pf
            else:
                step, ideal = self._step2.both(n, dec)
                self.pf_rate = 0.0
                self._pf_due = _INF
            self._roof = ideal / step
            if n:
                self.rate = 1.0 / step
                dv = self.batch[0][0] - self.V
                t_dec = tl + dv * step if dv > 0.0 else tl
                if t_dec < wake:
                    wake = t_dec
                if not self._reserve:
                    t_full = tl + ((self._full - used) / n) * step
                    if t_full < wake:
                        wake = t_full if t_full > tl else tl
            else:
                self.rate = 0.0
        if wake < _INF:  # SimCluster.schedule(wake, fire, ep), without the call
            heappush(self._q, (wake, next(self._tick), self._fire, ep))

    def touch(self, t: float) -> None:
        """After a change made from outside a wakeup (admission, migration): re-plan the next wakeup, once,
        after the current event is fully processed (nothing changes in simulated time meanwhile)."""
        self.advance(t)
        if not self._dirty:
            self._dirty = True
            self.cluster.replan(self)

    def fire(self, t: float, epoch: int) -> None:
        """Wakeup: segments that end leave the batch, tool calls return, prefills finish, a full KV preempts."""
        if epoch != self.epoch:
            return
        self.advance(t)
        kv = self.kv
        V = self.V
        used = kv.mem_fixed + kv.kv_dec_base + kv.n_dec * V + (kv.st * kv.holders if kv.st else 0.0)  # kv.used(V)
        if used > self.kv_peak:
            self.kv_peak = used
        heap = self.batch
        limit = V + _EPS * (V if V > 1.0 else 1.0)
        if heap and heap[0][0] <= limit:
            ready, seq = self.timers, self._seq
            while heap and heap[0][0] <= limit:
                ex = heappop(heap)[2]
                seg = ex.seg
                if seg == ex.last or t >= ex.deadline_at or ex.migrate_to is not None or ex.seg_done or ex.seg_cred:
                    kv.leave_decode(ex)
                    self._segment_end(ex, t)
                    continue
                # a tool-call boundary, the common case (as _segment_end, kept inline)
                gen = ex.gen[seg]
                ex.end_segment(self._version)
                ctx = ex.kv[seg] + gen
                nxt = ex.kv[seg + 1]
                if nxt < ctx:  # the context is rebuilt smaller
                    ctx = nxt - min(ex.tool_out[seg], nxt)
                kv.end_turn(ex, ctx)  # leave_decode, cache
                ex.ctx = nxt
                ex.seg = seg + 1
                r = ex.ready_at = t + ex.tool_s[seg] + self._req
                heappush(ready, (r, next(seq), ex))
            if kv.n_dec == 0:
                self._log(("busy", t, self.id, 0))
        pf = self.prefill
        if pf:
            # the head is done at its planned time (its residue may be below what the clock resolves)
            if t >= self._pf_due:
                kv.prefill_due(pf[0])
            while pf and pf[0].pf_left <= _EPS * (pf[0].resident + 1.0):
                ex = pf.popleft()
                kv.unprefill(ex)
                ex.wait()  # out of the prefill queue, not yet decoding
                self.decode(ex, t)
            if not pf:
                kv.prefill_empty()
        ready = self.timers
        if ready and ready[0][0] <= t:
            queue = self.queue
            while ready and ready[0][0] <= t:
                ex = heappop(ready)[2]
                ex.ready_at = None
                if t >= ex.deadline_at:
                    self.drop(ex)
                    self._finish(ex, t, "deadline")
                else:
                    ex.wait()
                    queue.append(ex)
        n = kv.n_dec
        if n and not self._reserve and kv.mem_fixed + kv.kv_dec_base + n * self.V + (kv.st * kv.holders if kv.st
                                                                                     else 0.0) + n > self._full:
            self.pressure.make_room(t)
        if self.queue:
            self.pressure.start_queued(t)
        self._reschedule()

    # --- an execution's turns on this engine ---
    def decode(self, ex: SimExecution, t: float) -> None:
        """Its context is all in KV: it joins the decode batch, unless its deadline has passed."""
        if t >= ex.deadline_at:
            self.drop(ex)
            self._finish(ex, t, "deadline")
            return
        V = self.V
        ex.start_decode(V, self._version)
        target = V + ex.gen[ex.seg] - ex.seg_done
        if self.kv.n_dec == 0:
            self._log(("busy", t, self.id, 1))
        self.kv.join_decode(ex, V)
        heappush(self.batch, (target, next(self._seq), ex))

    def _segment_end(self, ex: SimExecution, t: float) -> None:
        """A decoded segment ends (ex already left the batch): finish, or start its tool call."""
        seg = ex.seg
        gen = ex.gen[seg]
        ex.end_segment(self._version)
        ctx = ex.kv[seg] + gen  # the context after the segment
        self.kv.cache(ex, ctx)
        if seg == ex.last or t >= ex.deadline_at:
            self.drop(ex)
            why = "capped" if seg == ex.last and ex.spec.capped else ("done" if seg == ex.last else "deadline")
            self._finish(ex, t, why)
            return
        nxt = ex.kv[seg + 1]
        if nxt < ctx:  # compaction, a retry or a sub-agent's return: the context is rebuilt smaller
            self.kv.shrink(ex, nxt - min(ex.tool_out[seg], nxt))
        ex.ctx = nxt
        ex.seg = seg + 1
        r = ex.ready_at = t + ex.tool_s[seg] + self._req
        heappush(self.timers, (r, next(self._seq), ex))
        if ex.migrate_to is not None:
            self.cluster.migrate_at_boundary(ex, t)

    # --- leaving (finished, cut by its deadline, or moving away) ---
    def drop(self, ex: SimExecution) -> None:
        """Take ex (not decoding) off this engine and free its KV (and its reservation)."""
        del self.members[ex.id]
        ph = ex.phase
        if ph == _QUEUED:
            if ex in self.queue:
                self.queue.remove(ex)
        elif ph == _PREFILL:
            self.leave_prefill(ex)
        self.kv.free(ex)
        self.kv.unreserve(ex)
        ex.adm = -1
        ex.engine = None

    def leave_prefill(self, ex: SimExecution) -> None:
        """Take ex out of the prefill queue (not finished: it is dropped or preempted)."""
        self.prefill.remove(ex)
        self.kv.unprefill(ex)
        if not self.prefill:  # no float residue once the queue is empty
            self.kv.prefill_empty()

    # --- the engine's places, for gyre.sim.cluster.engine_moves ---
    def start_timer(self, ex: SimExecution, at: float) -> None:
        """Its tool call (or request) returns at `at`."""
        heappush(self.timers, (at, next(self._seq), ex))

    def clear(self) -> None:
        """Its process died: no members, nothing queued, decoding or in a tool call (their KV: KvLedger.wipe)."""
        self.members, self.batch, self.timers = {}, [], []
        self.queue.clear()
        self.prefill.clear()
        self.pressure.forget()
        self.paused = False

    def __repr__(self) -> str:
        return f"<engine {self.id} {self.state.value} live={self.n_live} dec={self.kv.n_dec}>"
