"""A fluid model of one inference engine (vLLM-like continuous batching, chunked prefill) on k GPUs.

Every decoding sequence advances one token per engine step, so all of them share one virtual token
clock V (tokens per sequence since the engine started). A step processes the n decodes and, within
the token budget `max_batched_tokens`, a chunk of the prefill queue (m = min(budget - n, pending)
tokens at the head's offset); it takes `Costs.step_time(n, K, m, offset)` seconds (gyre.roofline),
so prefill slows the decodes it shares a step with. Between changes of membership the step time is
held constant (the fluid model: K and the head's offset are sampled at events): V advances at
1 / step time and the prefill queue drains, head first, at m / step time tokens per second. Events
happen only when a segment ends, a tool returns, a prefill finishes, an execution is admitted,
migrated or preempted, KV fills, or weights sync; cost grows with executions and turns, never tokens.

An execution on an engine is in one of four places: the wait queue (QUEUED), the prefill queue
(PREFILL: its missing context is being computed), the decode batch (DECODE) or a tool call (TOOL, a
timer). Its next turn's context is `ctx`; `resident` of it is in KV; the rest (the tool's output,
or all of it after a preemption or a re-prefill migration) must be prefilled here before it decodes.

KV memory is a hard limit: KV in use is the resident context of every member plus the growing
contexts of the decodes, plus, for a hybrid linear-attention model, one fixed state (`Costs.state_tokens`,
in KV-token units) per member that holds KV (decoding, or with a resident context: a cached context is
resumable only with the state at its end), and never exceeds capacity. Leaving the wait queue (FIFO, head-of-line, as
vLLM schedules) reserves the tokens it will prefill. When growth would fill the memory an event
fires and the engine preempts, as vLLM does in recompute mode, the most recently admitted execution
holding KV: its KV is freed, it goes to the front of the wait queue (a tool call keeps running) and
later re-prefills its whole context; its generated tokens are kept. The context of an execution that
is not running (in a tool call, or waiting) is a cache, like vLLM's prefix cache of a finished request:
when the head of the wait queue does not fit, such contexts are evicted, newest first, if that makes
room (each logged as a preemption, since it will be recomputed). At most `max_num_seqs` executions
run (prefill queue plus decode batch), as in vLLM's scheduler: the wait queue's head starts only while
fewer run, so a waiting execution starts when a running one leaves (its segment ends, it is preempted
or dropped). Optional reservation mode admits an execution only if its largest context fits beside the
others' and never preempts (one that already holds its reservation, back from a tool call, does not wait
behind a head that cannot start). A context larger than the whole engine is a configuration error
(SimCluster.admit). `admit_limit` (gyre.hardware.admission_limit of the KV capacity and the workload's
`max_context`) is reported to policies, which hand the engine no more (policies.admit_queue). KV pressure
(preemption, eviction) lives in gyre.sim.cluster.kv_pressure, and migrations, crashes and weight syncs in
gyre.sim.cluster.engine_moves: both are mixins of SimEngine. The KV counters and each member's resident context are
written only by the engine's KvLedger (`kv`, gyre.sim.cluster.kv_ledger), which all of them call; the engine's
lifecycle and served version are gyre.backend.EngineLifecycle's.

Costs without a roofline use the linear step a + b n + c K + prefill_s_per_token m; a zero
prefill_s_per_token makes prefill free (no prefill queue), as in hand-built test scenarios. A nonzero
`Costs.request_s` (latency outside the engine, calibrated from a real run) delays each turn's request
before it reaches the wait queue: on admission and after each tool call the execution waits that long
as if in a tool call (a timer; it holds no KV beyond its resident context and uses no engine time).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from heapq import heappush
from typing import TYPE_CHECKING

from gyre.backend import READY, EngineLifecycle
from gyre.cluster import Phase
from gyre.hardware import admission_limit
from gyre.sim.cluster.kv_ledger import KvLedger
from gyre.sim.cluster.engine_moves import EngineMoves
from gyre.sim.cluster.kv_pressure import KvPressure

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster
    from gyre.sim.cluster.execution import SimExecution

_EPS = 1e-9
_INF = float("inf")
_FULL = 1.0 - 1e-9  # the KV-full event fires when use reaches this share of capacity
_TOOL, _PREFILL, _DECODE, _QUEUED = Phase.TOOL, Phase.PREFILL, Phase.DECODE, Phase.QUEUED


class SimEngine(EngineLifecycle, KvPressure, EngineMoves):
    # slots: the wakeup reads and writes a few dozen attributes per event, and an instance dict of this many
    # keys would fall off CPython's fast attribute path
    __slots__ = (
        "cluster", "id", "gpus", "costs", "members", "queue", "_heap", "_ready", "prefill", "kv", "_pf_due", "_adm",
        "V", "t_last", "rate", "pf_rate", "paused", "epoch", "_free_prefill", "_budget", "_max_seqs", "_reserve",
        "_kv_cap", "_full", "_req", "_schedule", "_fire", "_log", "kv_peak", "roof_s", "_roof", "_step2", "_seq",
        "_dirty", "_st", "_limit",
    )

    def __init__(self, cluster: SimCluster, engine_id: int, gpus: tuple[int, ...], version: int) -> None:
        EngineLifecycle.__init__(self, version)
        self.cluster = cluster
        self.id = engine_id
        self.gpus = gpus
        c = self.costs = cluster.costs
        self.members: dict[int, SimExecution] = {}  # every execution it holds, any phase
        self.queue: deque[SimExecution] = deque()  # waiting for KV to start its prefill
        self._heap: list[tuple[float, int, SimExecution]] = []  # decoding: (target V, seq, execution)
        self._ready: list[tuple[float, int, SimExecution]] = []  # tool calls: (return time, seq, execution)
        self.prefill: deque[SimExecution] = deque()  # prefill queue; ex.pf_left tokens still to compute
        self.kv = KvLedger(c.state_tokens)  # the KV counters (module docstring)
        self._pf_due = _INF  # when the prefill head is planned to finish
        self._adm: list[tuple[int, SimExecution]] = []  # (admission seq, execution), ascending; stale entries skipped
        self.V = 0.0
        self.t_last = 0.0
        self.rate = 0.0  # dV/dt
        self.pf_rate = 0.0  # prefill tokens per second
        self.paused = False
        self.epoch = 0  # invalidates stale wakeups
        self._dirty = False  # a re-plan of the next wakeup is pending (_touch)
        self._free_prefill = c.roofline is None and c.prefill_s_per_token == 0
        self._budget = c.max_batched_tokens
        self._max_seqs = c.max_num_seqs if c.max_num_seqs > 0 else _INF
        self._reserve = c.kv_reserve
        self._kv_cap = c.kv_capacity_tokens
        self._st = c.state_tokens  # a KV holder's linear-attention state, in KV tokens (0: none)
        self._full = c.kv_capacity_tokens * _FULL
        self._req = c.request_s
        self._schedule = cluster.schedule
        self._fire = self.fire
        self._log = cluster.log.append
        self.kv_peak = 0.0
        self.roof_s = 0.0  # integral of the roofline utilization (ideal / actual step time) over busy time
        self._roof = 0.0  # that share in the current plan
        # (step time, its ideal part at hardware peak) of a step: the roofline's, or the linear form's (no ideal)
        self._step2 = c.roofline.stepper() if c.roofline is not None else (
            lambda n, k, m=0.0, p=0.0: (c.step_time(n, k, m, p), 0.0))
        self._seq = itertools.count()
        self._limit = admission_limit(c.kv_capacity_tokens, cluster.source.config.max_context, c.admission_fill,
                                      c.state_tokens)

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
    def kv_capacity(self) -> int:
        return self._kv_cap

    @property
    def admit_limit(self) -> int:
        return self._limit

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

    def _used(self) -> float:
        return self.kv.used(self.V)

    def batch_size(self) -> int:
        """Entries of its decode batch (the checked run compares it with its members' phases)."""
        return len(self._heap)

    def replan_pending(self) -> None:
        """Plan the next wakeup if a change asked for it (_touch) since the last plan (SimCluster runs this once
        an event is fully processed)."""
        if self._dirty:
            self._reschedule()

    def _reschedule(self) -> None:
        """Plan this engine's next wakeup: a segment end, a tool return, the prefill head's end or KV full."""
        self._dirty = False
        self.epoch = ep = self.epoch + 1
        kv = self.kv
        n = kv.n_dec
        ready = self._ready
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
                step, ideal = self._step2(n, dec, m, head.resident - left)
                self.pf_rate = m / step
                t_pf = self._pf_due = tl + left * step / m
                if t_pf < wake:
                    wake = t_pf
            else:
                step, ideal = self._step2(n, dec)
                self.pf_rate = 0.0
                self._pf_due = _INF
            self._roof = ideal / step
            if n:
                self.rate = 1.0 / step
                dv = self._heap[0][0] - self.V
                t_dec = tl + dv * step if dv > 0.0 else tl
                if t_dec < wake:
                    wake = t_dec
                if not self._reserve:
                    t_full = tl + ((self._full - used) / n) * step
                    if t_full < wake:
                        wake = t_full if t_full > tl else tl
            else:
                self.rate = 0.0
        if wake < _INF:
            self._schedule(wake, self._fire, ep)

    def _touch(self, t: float) -> None:
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
        V = self.V
        kv = self.kv
        used = kv.used(V)
        if used > self.kv_peak:
            self.kv_peak = used
        heap = self._heap
        limit = V + _EPS * (V if V > 1.0 else 1.0)
        if heap and heap[0][0] <= limit:
            pop, push, ready, seq = heapq.heappop, heapq.heappush, self._ready, self._seq
            while heap and heap[0][0] <= limit:
                ex = pop(heap)[2]
                kv.leave_decode(ex)
                seg = ex.seg
                if seg == ex.last or t >= ex.deadline_at or ex.migrate_to is not None or ex.seg_done or ex.seg_cred:
                    self._segment_end(ex, t)
                    continue
                # a tool-call boundary, the common case (as _segment_end, kept inline)
                gen = ex.gen[seg]
                ex.generated += gen
                ex.vsum += gen * self._version
                ctx = ex.kv[seg] + gen
                ex.phase = _TOOL
                nxt = ex.kv[seg + 1]
                if nxt < ctx:  # the context is rebuilt smaller
                    ctx = nxt - min(ex.tool_out[seg], nxt)
                kv.cache(ex, ctx)
                ex.ctx = nxt
                ex.seg = seg + 1
                r = ex.ready_at = t + ex.tool_s[seg] + self._req
                push(ready, (r, next(seq), ex))
            if kv.n_dec == 0:
                self._log(("busy", t, self.id, 0))
        pf = self.prefill
        if pf:
            # the head is done at its planned time (its residue may be below what the clock resolves)
            if t >= self._pf_due:
                pf[0].pf_left = 0.0
            while pf and pf[0].pf_left <= _EPS * (pf[0].resident + 1.0):
                ex = pf.popleft()
                kv.unprefill(ex)
                ex.phase = _QUEUED  # out of the prefill queue, not yet decoding
                self._decode(ex, t)
            if not pf:
                kv.prefill_empty()
        ready = self._ready
        if ready and ready[0][0] <= t:
            queue = self.queue
            while ready and ready[0][0] <= t:
                ex = heapq.heappop(ready)[2]
                ex.ready_at = None
                if t >= ex.deadline_at:
                    self._drop(ex)
                    self.cluster.finish(ex, t, "deadline")
                else:
                    ex.phase = _QUEUED
                    queue.append(ex)
        n = kv.n_dec
        if n and not self._reserve and kv.used(self.V) + n > self._full:
            self._make_room(t)
        if self.queue:
            self._drain_queue(t)
        self._reschedule()

    # --- execution lifecycle on this engine ---
    def admit(self, ex: SimExecution, t: float) -> None:
        """A fresh execution (it holds no KV) joins: it waits for its first request (request_s), or for KV."""
        self.advance(t)
        ex.engine = self
        ex.phase = _QUEUED
        ex.ctx = ex.kv[0]
        self.members[ex.id] = ex
        if self._req:  # its first request is on its way to the engine
            ex.phase = _TOOL
            r = ex.ready_at = t + self._req
            heapq.heappush(self._ready, (r, next(self._seq), ex))
        else:
            self.queue.append(ex)
            self._drain_queue(t)
        self._touch(t)

    def _drain_queue(self, t: float) -> None:
        """Start the prefill of waiting executions in order while their missing context fits (head-of-line)
        and fewer than max_num_seqs run."""
        queue = self.queue
        if not queue or self.state is not READY:
            return
        reserve = self._reserve
        kv = self.kv
        while queue:
            if kv.n_dec + len(self.prefill) >= self._max_seqs:
                break
            ex = queue[0]
            need = ex.ctx - ex.resident
            if reserve:
                if not ex.reserved and kv.reserved + ex.max_ctx + self._st > self._full:
                    # an execution behind it that holds a reservation needs no new memory: it goes first
                    # (it may be what the head waits for)
                    ex = next((x for x in queue if x.reserved), None)
                    if ex is None:
                        break
                    need = ex.ctx - ex.resident
            else:
                n = kv.n_dec  # over = _used() + need (+ its state) + n + 1 - full, leaving a step of headroom
                over = kv.used(self.V) + need + (self._st if ex.resident <= 0 else 0.0) + n + 1 - self._full
                if over > 0:
                    # the KV of executions that are not running (tool calls, waiting) is a cache: evict it,
                    # newest first, if that makes room; otherwise wait for the running ones to free theirs
                    if self._idle_kv(ex) < over:
                        break
                    self._evict_idle(over, ex, t)
            if ex is queue[0]:
                queue.popleft()
            else:
                queue.remove(ex)
            if reserve and not ex.reserved:
                kv.reserve(ex, ex.max_ctx + self._st)
            if ex.started_at is None:
                ex.started_at = t
                ex.deadline_at = t + ex.spec.deadline_s
                self._log(("start", t, ex.id, self.id))
            self._admitted(ex)
            kv.load(ex, need)
            if need <= 0 or self._free_prefill:
                self._decode(ex, t)
            else:
                ex.phase = _PREFILL
                kv.queue_prefill(ex, need)
                self.prefill.append(ex)

    def _decode(self, ex: SimExecution, t: float) -> None:
        """Its context is all in KV: it joins the decode batch, unless its deadline has passed."""
        if t >= ex.deadline_at:
            self._drop(ex)
            self.cluster.finish(ex, t, "deadline")
            return
        ex.phase = _DECODE
        V = self.V
        ex.v_start = V
        target = V + ex.gen[ex.seg] - ex.seg_done
        if ex.first_version is None or self._version < ex.first_version:
            ex.first_version = self._version
        if self.kv.n_dec == 0:
            self._log(("busy", t, self.id, 1))
        self.kv.join_decode(ex, V)
        heappush(self._heap, (target, next(self._seq), ex))

    def _segment_end(self, ex: SimExecution, t: float) -> None:
        """A decoded segment ends (ex already left the batch): finish, or start its tool call."""
        seg = ex.seg
        gen = ex.gen[seg]
        ex.generated += gen
        ex.vsum += (gen - ex.seg_cred) * self._version  # the segment's tokens not yet counted, at this version
        ex.seg_cred = 0.0
        ex.seg_done = 0
        ctx = ex.kv[seg] + gen  # the context after the segment
        ex.phase = _TOOL
        self.kv.cache(ex, ctx)
        if seg == ex.last or t >= ex.deadline_at:
            self._drop(ex)
            why = "capped" if seg == ex.last and ex.spec.capped else ("done" if seg == ex.last else "deadline")
            self.cluster.finish(ex, t, why)
            return
        nxt = ex.kv[seg + 1]
        if nxt < ctx:  # compaction, a retry or a sub-agent's return: the context is rebuilt smaller
            self.kv.shrink(ex, nxt - min(ex.tool_out[seg], nxt))
        ex.ctx = nxt
        ex.seg = seg + 1
        r = ex.ready_at = t + ex.tool_s[seg] + self._req
        heapq.heappush(self._ready, (r, next(self._seq), ex))
        if ex.migrate_to is not None:
            self.cluster.migrate_at_boundary(ex, t)

    # --- leaving (finished, cut by its deadline, or moving away) ---
    def _drop(self, ex: SimExecution) -> None:
        """Take ex (not decoding) off this engine and free its KV (and its reservation)."""
        del self.members[ex.id]
        kv = self.kv
        ph = ex.phase
        if ph == _QUEUED:
            if ex in self.queue:
                self.queue.remove(ex)
        elif ph == _PREFILL:
            self._leave_prefill(ex)
        kv.free(ex)
        kv.unreserve(ex)
        ex.adm = -1
        ex.engine = None

    def _leave_prefill(self, ex: SimExecution) -> None:
        """Take ex out of the prefill queue (not finished: it is dropped or preempted)."""
        self.prefill.remove(ex)
        self.kv.unprefill(ex)
        if not self.prefill:  # no float residue once the queue is empty
            self.kv.prefill_empty()

    def __repr__(self) -> str:
        return f"<engine {self.id} {self.state.value} live={self.n_live} dec={self.kv.n_dec}>"
