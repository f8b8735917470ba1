"""KV memory pressure on a simulated engine: who starts from the wait queue, whose KV is preempted or evicted.

An object the engine (gyre.sim.cluster.engine.SimEngine) owns, one per engine: it decides whose KV goes when memory is
short and keeps the order of admissions that decision follows; the engine's KvLedger (gyre.sim.cluster.kv_ledger)
carries every change of the books out, and the engine's public methods move executions between its queues.

What it models (vLLM's scheduler in recompute mode):
- Leaving the wait queue (FIFO, head-of-line) reserves the tokens the execution will prefill. At most
  `max_num_seqs` executions run (prefill queue plus decode batch): the head starts only while fewer run, so a
  waiting execution starts when a running one leaves (its segment ends, it is preempted or dropped).
- When growth would fill the memory the engine preempts the most recently admitted execution holding KV: its
  KV is freed, it goes to the front of the wait queue (a running tool call keeps running) and later
  re-prefills its whole context; its generated tokens are kept.
- The context of an execution that is not running (in a tool call, or waiting) is a cache, like vLLM's prefix
  cache of a finished request: when the head of the wait queue does not fit, such contexts are evicted, newest
  first, if that makes room (each logged as a preemption, since it will be recomputed).
- Optional reservation mode admits an execution only if its largest context fits beside the others' and never
  preempts (one that already holds its reservation, back from a tool call, does not wait behind a head that
  cannot start).
Every preemption or eviction is logged ("preempt", t, exec, engine, tokens to recompute, GPU-seconds that
recomputation costs at the engine's prefill speed).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from gyre.engine_lifecycle import READY
from gyre.cluster import Phase
from gyre.sim.cluster.time_heap import heapify

if TYPE_CHECKING:
    from gyre.sim.cluster.engine import SimEngine
    from gyre.sim.cluster.execution import SimExecution

_TOOL, _PREFILL, _DECODE, _QUEUED = Phase.TOOL, Phase.PREFILL, Phase.DECODE, Phase.QUEUED
_FULL = 1.0 - 1e-9  # memory counts as full at this share of capacity (the engine's KV-full event fires there)


class KvPressure:
    __slots__ = ("engine", "kv", "queue", "prefill", "_adm", "_n", "full", "_st", "_reserve", "_max_seqs", "_log",
                 "_prefill_time", "_gpus", "_free_prefill")

    def __init__(self, engine: SimEngine) -> None:
        c = engine.costs
        self.engine = engine
        self.kv = engine.kv
        self.queue, self.prefill = engine.queue, engine.prefill  # its wait and prefill queues (emptied in place)
        self._adm: list[tuple[int, SimExecution]] = []  # (admission number, execution), ascending; stale skipped
        self._n = itertools.count()
        self.full = c.kv_capacity_tokens * _FULL  # KV tokens that count as full
        self._st = c.state_tokens  # a KV holder's linear-attention state, in KV tokens (0: none)
        self._reserve = c.kv_reserve
        self._max_seqs = c.max_num_seqs if c.max_num_seqs > 0 else float("inf")
        self._log = engine.cluster.log.append
        self._prefill_time = c.prefill_time
        self._gpus = len(engine.gpus)
        self._free_prefill = c.roofline is None and c.prefill_s_per_token == 0  # no prefill queue

    def forget(self) -> None:
        """The engine lost every member (its process died): no admission is remembered."""
        self._adm = []

    # --- the wait queue ---
    def start_queued(self, t: float) -> None:
        """Start the prefill of waiting executions in order while their missing context fits (head-of-line)
        and fewer than max_num_seqs run; one whose context is all resident decodes at once."""
        e = self.engine
        queue = self.queue
        if not queue or e.state is not READY:
            return
        reserve, kv, full, st, prefill = self._reserve, self.kv, self.full, self._st, self.prefill
        while queue:
            if kv.n_dec + len(prefill) >= self._max_seqs:
                break
            ex = queue[0]
            need = ex.ctx - ex.resident
            if reserve:
                if not ex.reserved and kv.reserved + ex.max_ctx + st > full:
                    # an execution behind it that holds a reservation needs no new memory: it goes first
                    # (it may be what the head waits for)
                    ex = _first_reserved(queue)
                    if ex is None:
                        break
                    need = ex.ctx - ex.resident
            else:
                n = kv.n_dec  # over = used + need (+ its state) + n + 1 - full, leaving a step of headroom
                over = kv.used(e.V) + need + (st if ex.resident <= 0 else 0.0) + n + 1 - full
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
                kv.reserve(ex, ex.max_ctx + st)
            if ex.started_at is None:  # its deadline clock starts when it first runs
                ex.started_at = t
                ex.deadline_at = t + ex.spec.deadline_s
                self._log(("start", t, ex.id, e.id))
            self.admitted(ex)
            if need <= 0 or self._free_prefill:
                kv.load(ex, need)
                e.decode(ex, t)
            else:
                ex.start_prefill()
                kv.load_prefill(ex, need)
                prefill.append(ex)

    # --- admission order ---
    def admitted(self, ex: SimExecution) -> None:
        """Record an admission (preemption takes the newest first); stale records are pruned now and then."""
        ex.adm = a = next(self._n)
        adm = self._adm
        adm.append((a, ex))
        if len(adm) > 64 and len(adm) > 4 * len(self.engine.members):
            e = self.engine
            self._adm = [(b, x) for b, x in adm if x.engine is e and x.adm == b]

    def _newest_holder(self) -> SimExecution | None:
        """The most recently admitted member that holds KV or decodes."""
        adm, e = self._adm, self.engine
        while adm:
            a, ex = adm[-1]
            if ex.engine is e and ex.adm == a and (ex.phase == _DECODE or ex.resident > 0):
                return ex
            adm.pop()
        return None

    # --- taking KV away ---
    def make_room(self, t: float) -> None:
        """KV is full and decodes still grow: preempt the newest holders until one more step fits."""
        kv, e = self.kv, self.engine
        while kv.n_dec and kv.used(e.V) + kv.n_dec > self.full:
            ex = self._newest_holder()
            if ex is None:
                break
            self.preempt(ex, t)

    def preempt(self, ex: SimExecution, t: float, requeue: bool = True) -> None:
        """Free ex's KV; it waits at the front of the queue (a running tool call keeps running) and later
        re-prefills its whole context. Its tokens are kept; the recomputation is logged with its GPU-s."""
        e = self.engine
        kv = self.kv
        if ex.phase == _DECODE:  # it leaves the batch mid-segment: what it decoded is kept, at this version
            done = e.V - ex.v_start
            batch = e.batch
            batch[:] = [x for x in batch if x[2] is not ex]
            heapify(batch)
            kv.leave_decode(ex)
            ex.seg_done += done
            ex.credit_decoded(ex.seg_done, e.version)
            ex.ctx += done
            if kv.n_dec == 0:
                self._log(("busy", t, e.id, 0))
            lost = ex.ctx
        else:
            lost = ex.resident
            if ex.phase == _PREFILL:
                lost -= ex.pf_left
                e.leave_prefill(ex)
            elif ex.phase == _QUEUED and requeue:
                self.queue.remove(ex)
            kv.free(ex)
        ex.adm = -1
        self._log(("preempt", t, ex.id, e.id, lost, self._prefill_time(lost) * self._gpus))
        if ex.phase != _TOOL and requeue:
            ex.wait()
            self.queue.appendleft(ex)

    def _idle_kv(self, keep: SimExecution) -> float:
        """KV (with their states) held by members that are not running, but for `keep`: what eviction can free."""
        idle = self.kv.mem_fixed - self.kv.pf_resident - keep.resident
        if self._st:
            n = 0
            for x in self.engine.members.values():
                if x is not keep and x.resident > 0 and x.phase in (_TOOL, _QUEUED):
                    n += 1
            idle += self._st * n
        return idle

    def _evict_idle(self, over: float, keep: SimExecution, t: float) -> None:
        """Free at least `over` KV tokens held by executions that are not running (not `keep`), newest first."""
        e = self.engine
        for a, ex in reversed(self._adm):  # preempt() does not touch the list
            if over <= 0:
                return
            if ex.engine is e and ex.adm == a and ex is not keep and ex.resident > 0 \
                    and ex.phase in (_TOOL, _QUEUED):
                over -= ex.resident + self._st
                self.preempt(ex, t, requeue=False)


def _first_reserved(queue):
    """The first waiting execution that holds a reservation, if any."""
    for x in queue:
        if x.reserved:
            return x
    return None
