"""KV memory pressure on a simulated engine: admission order, preemption by recompute, idle-context eviction.

A mixin of SimEngine (gyre.sim.cluster.engine), kept apart because it decides whose KV goes when memory is short (the
engine's KvLedger, gyre.sim.cluster.kv_ledger, carries every change of the books out). vLLM's recompute mode: the most
recently admitted execution holding KV is preempted first; its KV is freed and it later re-prefills its whole context (its generated tokens are kept). Contexts
of executions that are not running (in a tool call, or waiting) are an evictable cache. Every
preemption or eviction is logged ("preempt", t, exec, engine, tokens to recompute, GPU-seconds that
recomputation costs at the engine's prefill speed).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from gyre.cluster import Phase

if TYPE_CHECKING:
    from gyre.sim.cluster.execution import SimExecution

_TOOL, _PREFILL, _DECODE, _QUEUED = Phase.TOOL, Phase.PREFILL, Phase.DECODE, Phase.QUEUED


class KvPressure:
    """Needs from the engine: members, queue, _heap, _adm, _seq, V, kv (its KvLedger), gpus, costs, _full, _st,
    _used(), _leave_prefill(), _log."""

    __slots__ = ()

    def _admitted(self, ex: SimExecution) -> None:
        """Record an admission (preemption takes the newest first); stale records are pruned now and then."""
        ex.adm = a = next(self._seq)
        adm = self._adm
        adm.append((a, ex))
        if len(adm) > 64 and len(adm) > 4 * len(self.members):
            self._adm = [(b, x) for b, x in adm if x.engine is self and x.adm == b]

    def _newest_holder(self) -> SimExecution | None:
        """The most recently admitted member that holds KV or decodes."""
        adm = self._adm
        while adm:
            a, ex = adm[-1]
            if ex.engine is self and ex.adm == a and (ex.phase == _DECODE or ex.resident > 0):
                return ex
            adm.pop()
        return None

    def _make_room(self, t: float) -> None:
        """KV is full and decodes still grow: preempt the newest holders until one more step fits."""
        kv = self.kv
        while kv.n_dec and self._used() + kv.n_dec > self._full:
            ex = self._newest_holder()
            if ex is None:
                break
            self.preempt(ex, t)

    def preempt(self, ex: SimExecution, t: float, requeue: bool = True) -> None:
        """Free ex's KV; it waits at the front of the queue (a running tool call keeps running) and later
        re-prefills its whole context. Its tokens are kept; the recomputation is logged with its GPU-s."""
        kv = self.kv
        if ex.phase == _DECODE:
            done = self.V - ex.v_start
            self._heap = [x for x in self._heap if x[2] is not ex]
            heapq.heapify(self._heap)
            kv.leave_decode(ex)
            ex.seg_done += done
            ex.vsum += (ex.seg_done - ex.seg_cred) * self._version  # decoded so far, at this version
            ex.seg_cred = ex.seg_done
            ex.ctx += done
            if kv.n_dec == 0:
                self._log(("busy", t, self.id, 0))
            lost = ex.ctx
        else:
            lost = ex.resident
            if ex.phase == _PREFILL:
                lost -= ex.pf_left
                self._leave_prefill(ex)
            elif ex.phase == _QUEUED and requeue:
                self.queue.remove(ex)
            kv.free(ex)
        ex.adm = -1
        gpu_s = self.costs.prefill_time(lost) * len(self.gpus)
        self._log(("preempt", t, ex.id, self.id, lost, gpu_s))
        if ex.phase != _TOOL and requeue:
            ex.phase = _QUEUED
            self.queue.appendleft(ex)

    def _idle_kv(self, keep: SimExecution) -> float:
        """KV (with their states) held by members that are not running, but for `keep`: what eviction can free."""
        idle = self.kv.mem_fixed - self.kv.pf_resident - keep.resident
        if self._st:
            idle += self._st * sum(1 for x in self.members.values()
                                   if x is not keep and x.resident > 0 and x.phase in (_TOOL, _QUEUED))
        return idle

    def _evict_idle(self, over: float, keep: SimExecution, t: float) -> None:
        """Free at least `over` KV tokens held by executions that are not running (not `keep`), newest first."""
        for a, ex in reversed(self._adm):  # preempt() does not touch the list
            if over <= 0:
                return
            if ex.engine is self and ex.adm == a and ex is not keep and ex.resident > 0 \
                    and ex.phase in (_TOOL, _QUEUED):
                over -= ex.resident + self._st
                self.preempt(ex, t, requeue=False)
