"""A fluid model of one inference engine (vLLM-like continuous batching) on k GPUs.

Every decoding sequence advances one token per engine step, so all of them share one virtual token
clock V (tokens per sequence since the engine started). With n decoding sequences holding K KV
tokens, a step takes a + b*n + c*K seconds (hardware.Costs), so dV/dt = 1 / step_time. The rate is
held constant between changes of batch membership (the fluid model): events happen only when a
segment ends, a tool returns, an execution is admitted, migrated or finished, or weights sync.
A heap of per-sequence target V values gives the next segment end in O(log n), and a second heap
holds the executions between turns (tool call or prefill) by the time they rejoin; the engine keeps
one wakeup in the backend's queue at the earlier of the two. Cost grows with executions and turns,
never with tokens.

Memory: an execution's resident KV is its context; admission is gated on current usage (plus the
new prompt) against capacity; contexts then grow turn by turn. Admitted executions are never evicted;
any overshoot past capacity is recorded as `kv_peak` (a real engine would preempt and recompute).

Simplifications: prefill (prompt, tool output, a migrated context) delays only its own execution and
does not slow the decode batch; K is sampled at events, not integrated continuously.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from gyre.cluster import Phase

if TYPE_CHECKING:
    from gyre.sim.backend import SimCluster
    from gyre.sim.execution import SimExecution

_EPS = 1e-9
_INF = float("inf")
_TOOL = Phase.TOOL
_PREFILL = Phase.PREFILL


class SimEngine:
    def __init__(self, cluster: SimCluster, engine_id: int, gpus: tuple[int, ...], version: int) -> None:
        self.cluster = cluster
        self.id = engine_id
        self.gpus = gpus
        self._version = version
        self.costs = cluster.costs
        self.state = "starting"  # starting -> ready -> stopping -> stopped
        self.members: dict[int, SimExecution] = {}  # every execution it holds, any phase
        self.queue: deque[SimExecution] = deque()
        self._heap: list[tuple[float, int, SimExecution]] = []  # decoding: (target V, seq, execution)
        self._ready: list[tuple[float, int, SimExecution]] = []  # between turns: (rejoin time, seq, execution)
        self.V = 0.0
        self.t_last = 0.0
        self.rate = 0.0
        self.n_dec = 0
        self.kv_dec_base = 0.0  # sum(kv_seg - v_start) over decoding executions
        self.mem_fixed = 0  # resident KV of non-decoding executions
        self.paused = False
        self.epoch = 0  # invalidates stale wakeups
        self._q = cluster._q  # the backend's fine-event heap, pushed directly on the hot path
        self._qseq = cluster._seq
        self._prefill = cluster.costs.prefill_s_per_token
        self._kv_cap = cluster.costs.kv_capacity_tokens
        self._log = cluster.log.append
        self.kv_peak = 0.0
        self._seq = 0
        self._dirty = False  # a re-plan is pending in cluster._dirty

    # --- EngineView ---
    @property
    def version(self) -> int:
        return self._version

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def n_live(self) -> int:
        return len(self.members)

    @property
    def n_decoding(self) -> int:
        return self.n_dec

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def kv_capacity(self) -> int:
        return self.costs.kv_capacity_tokens

    @property
    def kv_used(self) -> float:
        v = self.V + (self.cluster.now - self.t_last) * self.rate
        return self.mem_fixed + self.kv_dec_base + self.n_dec * v

    # --- fluid clock ---
    def _advance(self, t: float) -> None:
        if self.rate:
            self.V += (t - self.t_last) * self.rate
        self.t_last = t

    def _reschedule(self) -> None:
        """Put this engine's next wakeup in the backend's queue (earlier ones become stale)."""
        self._dirty = False
        self.epoch += 1
        n = self.n_dec
        wake = self._ready[0][0] if self._ready else _INF
        if n == 0 or self.paused:
            self.rate = 0.0
        else:
            kv = self.kv_dec_base + n * self.V
            c = self.costs
            rate = self.rate = 1.0 / (c.step_a + c.step_b * n + c.step_c * kv)
            used = self.mem_fixed + kv
            if used > self.kv_peak:
                self.kv_peak = used
            dt = (self._heap[0][0] - self.V) / rate
            t_dec = self.t_last + (dt if dt > 0.0 else 0.0)
            if t_dec < wake:
                wake = t_dec
        if wake < _INF:
            heapq.heappush(self._q, (wake, next(self._qseq), self.fire, self.epoch))

    def _touch(self, t: float) -> None:
        """After a change made from outside a wakeup (admission, migration): re-plan the next wakeup.

        The re-plan waits until the current event is fully processed (SimCluster.run flushes
        cluster._dirty), so admitting a whole batch to an engine costs one wakeup, not one each.
        Nothing changes in simulated time meanwhile, so the plan is the same."""
        self._advance(t)
        if not self._dirty:
            self._dirty = True
            self.cluster._dirty.append(self)

    def fire(self, t: float, epoch: int) -> None:
        """Wakeup: segments that end now leave the batch; executions whose tool returned rejoin it."""
        if epoch != self.epoch:
            return
        if self.rate:
            self.V += (t - self.t_last) * self.rate
        self.t_last = t
        heap = self._heap
        V = self.V
        limit = V + _EPS * (V if V > 1.0 else 1.0)
        pop = heapq.heappop
        busy = self.n_dec > 0
        while heap and heap[0][0] <= limit:
            ex = pop(heap)[2]
            # the execution leaves the decode batch
            self.n_dec -= 1
            self.kv_dec_base -= ex.kv_seg - ex.v_start
            seg = ex.seg
            gen = ex.gen[seg]
            ex.generated += gen
            if seg == ex.last or t >= ex.deadline_at or ex.migrate_to is not None:
                self._end_segment(ex, t, seg, gen)
                continue
            # a tool-call boundary (the common case, kept inline)
            out = ex.tool_out[seg]
            ex.phase = _TOOL
            r = ex.resident = ex.kv_seg + gen + out
            self.mem_fixed += r
            ex.seg = seg + 1
            r = ex.ready_at = t + ex.tool_s[seg] + out * self._prefill
            heapq.heappush(self._ready, (r, next(self._qseq), ex))
        if busy and self.n_dec == 0:
            self._log(("busy", t, self.id, 0))
        ready = self._ready
        while ready and ready[0][0] <= t:
            ex = pop(ready)[2]
            ex.ready_at = None
            self._rejoin(ex, t)
        self._reschedule()

    # --- execution lifecycle on this engine ---
    def admit(self, ex: SimExecution, t: float) -> None:
        ex.engine = self
        ex.phase = Phase.QUEUED
        self.members[ex.id] = ex
        self.queue.append(ex)
        self._drain_queue(t)
        self._touch(t)

    def _fits(self, tokens: float, t: float) -> bool:
        """Admission gate: KV in use at time t plus `tokens` within capacity (an idle engine takes one)."""
        if len(self.members) == len(self.queue):  # nothing running: always take one
            return True
        used = self.mem_fixed + self.kv_dec_base + self.n_dec * (self.V + (t - self.t_last) * self.rate)
        return used + tokens <= self._kv_cap

    def _drain_queue(self, t: float) -> None:
        queue = self.queue
        while queue and self.state == "ready" and self._fits(queue[0].kv[0], t):
            ex = queue.popleft()
            if ex.started_at is None:
                ex.started_at = t
                ex.deadline_at = t + ex.spec.deadline_s
                self._log(("start", t, ex.id, self.id))
            ex.phase = _PREFILL
            r = ex.resident = ex.kv[0]
            self.mem_fixed += r
            r = ex.ready_at = t + ex.spec.prompt * self._prefill
            heapq.heappush(self._ready, (r, next(self._qseq), ex))

    def _rejoin(self, ex: SimExecution, t: float) -> None:
        """A tool call (or prefill) is over: the execution decodes its next segment, unless it is late."""
        if t < ex.ready_min:  # a migrated context is still being prefilled here
            ex.ready_at = ex.ready_min
            heapq.heappush(self._ready, (ex.ready_min, next(self._qseq), ex))
            return
        if t >= ex.deadline_at:
            self.remove(ex)
            self.cluster._finish(ex, t, truncated=True)
            return
        self.mem_fixed -= ex.resident
        ex.resident = 0
        ex.phase = Phase.DECODE
        V = self.V
        seg = ex.seg
        kv = ex.kv_seg = ex.kv[seg]
        ex.v_start = V
        target = ex.v_target = V + ex.gen[seg]
        if ex.first_version is None or self._version < ex.first_version:
            ex.first_version = self._version
        if self.n_dec == 0:
            self._log(("busy", t, self.id, 1))
        self.n_dec += 1
        self.kv_dec_base += kv - V
        self._seq += 1
        heapq.heappush(self._heap, (target, self._seq, ex))

    def _end_segment(self, ex: SimExecution, t: float, seg: int, gen: int) -> None:
        """Segment end off the common path: the execution finishes, or migrates at this boundary."""
        if seg == ex.last or t >= ex.deadline_at:
            ex.resident = ex.kv_seg + gen
            ex.phase = Phase.TOOL  # off the batch; its KV is now counted as resident
            self.mem_fixed += ex.resident
            self.remove(ex)
            self.cluster._finish(ex, t, truncated=ex.spec.capped or seg < ex.last)
            return
        out = ex.tool_out[seg]
        ex.phase = Phase.TOOL
        ex.resident = ex.kv_seg + gen + out
        self.mem_fixed += ex.resident
        ex.seg = seg + 1
        r = ex.ready_at = t + ex.tool_s[seg] + out * self._prefill
        heapq.heappush(self._ready, (r, next(self._qseq), ex))
        self.cluster._do_migrate(ex, t)

    def remove(self, ex: SimExecution) -> None:
        """Take a non-decoding execution off this engine (finish or migration) and free its KV.

        A pending rejoin leaves with it (ex.ready_at keeps its time for the next engine)."""
        del self.members[ex.id]
        if ex.phase == Phase.QUEUED:
            self.queue.remove(ex)
        else:
            self.mem_fixed -= ex.resident
        if ex.ready_at is not None:
            self._ready = [x for x in self._ready if x[2] is not ex]
            heapq.heapify(self._ready)
        ex.engine = None
        self._drain_queue(self.cluster.env._now)

    def add_migrated(self, ex: SimExecution, t: float) -> None:
        """Take an execution that is between turns (or still queued) from another engine."""
        ex.engine = self
        self.members[ex.id] = ex
        if ex.phase == Phase.QUEUED:
            self.queue.append(ex)
            self._drain_queue(t)
        else:
            self.mem_fixed += ex.resident
            heapq.heappush(self._ready, (ex.ready_at, next(self._qseq), ex))
        self._touch(t)

    # --- weights ---
    def pause(self, t: float) -> None:
        self._advance(t)
        self.paused = True
        self._reschedule()

    def resume(self, t: float, version: int) -> None:
        self._advance(t)
        self.paused = False
        self._version = version
        self._reschedule()

    def __repr__(self) -> str:
        return f"<engine {self.id} {self.state} live={self.n_live} dec={self.n_dec}>"
