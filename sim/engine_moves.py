"""Executions moving on and off a simulated engine, and the engine losing its process or its weights.

A mixin of SimEngine (gyre.sim.engine), kept apart from the engine's event loop: what the cluster does to
an engine from outside (gyre.sim.backend): a migration takes a between-turns execution off one engine
(`remove`) and gives it to another (`add_migrated`: its KV arrives resident if it was transferred and
fits, otherwise it re-prefills there); a crash loses every member's unfinished segment (`wipe`); a
weight sync pauses decoding and resumes it at the new version, crediting the tokens decoded so far
to the old one.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from gyre.cluster import Phase

if TYPE_CHECKING:
    from gyre.sim.execution import SimExecution

_TOOL, _DECODE, _QUEUED = Phase.TOOL, Phase.DECODE, Phase.QUEUED


class EngineMoves:
    """Needs from the engine: cluster, members, queue, prefill, _heap, _ready, _adm, _seq, V, n_dec,
    kv_dec_base, mem_fixed, reserved, pf_pending, pf_resident, paused, _version, _full, _log, _advance(),
    _used(), _drop(), _admitted(), _drain_queue(), _touch(), _reschedule()."""

    __slots__ = ()

    def remove(self, ex: SimExecution) -> None:
        """Take a non-decoding execution off this engine (migration); a pending tool call leaves with it."""
        self._advance(self.cluster.now)
        if ex.ready_at is not None:
            self._ready = [x for x in self._ready if x[2] is not ex]
            heapq.heapify(self._ready)
        self._drop(ex)
        self._drain_queue(self.cluster.now)
        self._touch(self.cluster.now)

    def add_migrated(self, ex: SimExecution, t: float, kv_fits_free: bool) -> None:
        """Take an execution that is between turns (or waiting) from another engine. With `kv_fits_free`
        (its KV was transferred and fits here) its context arrives resident; otherwise it re-prefills."""
        self._advance(t)
        ex.engine = self
        self.members[ex.id] = ex
        if kv_fits_free and ex.resident and self._used() + ex.resident + self._st + self.n_dec + 1 <= self._full:
            self.mem_fixed += ex.resident
            self._admitted(ex)
        else:
            ex.resident = 0
        if ex.ready_at is not None:
            ex.phase = _TOOL
            heapq.heappush(self._ready, (ex.ready_at, next(self._seq), ex))
        else:
            ex.phase = _QUEUED
            self.queue.append(ex)
            self._drain_queue(t)
        self._touch(t)

    # --- losing the process ---
    def wipe(self, t: float) -> tuple[list[SimExecution], float]:
        """The engine's process died at t: every member leaves it, in id order, holding no KV. The unfinished
        part of a segment (decoding, or kept by a preemption) is lost and decoded again (nothing of it was
        recorded); a tool call keeps running. Returns the members, detached, and the decoded tokens lost."""
        self._advance(t)
        if self.n_dec:
            self._log(("busy", t, self.id, 0))
        out = sorted(self.members.values(), key=lambda x: x.id)
        lost = 0.0
        for ex in out:
            lost += ex.seg_done + (self.V - ex.v_start if ex.phase == _DECODE else 0.0)
            ex.ctx = ex.kv[ex.seg]
            ex.seg_done = 0.0
            ex.phase = _TOOL if ex.ready_at is not None else _QUEUED
            ex.resident = ex.reserved = 0
            ex.adm = -1
            ex.pf_left = 0.0
            ex.engine = None
        self.members = {}
        self.queue.clear()
        self.prefill.clear()
        self._heap, self._ready, self._adm = [], [], []
        self.n_dec = 0
        self.kv_dec_base = self.mem_fixed = self.reserved = self.pf_pending = self.pf_resident = 0.0
        self.paused = False
        self._reschedule()  # nothing left to plan: invalidates the pending wakeup
        return out, lost

    # --- weights ---
    def pause(self, t: float) -> None:
        self._advance(t)
        self.paused = True
        self._reschedule()

    def resume(self, t: float, version: int) -> None:
        self._advance(t)
        for _, _, ex in self._heap:  # tokens decoded so far in the current segment were the old version's
            done = ex.seg_done + self.V - ex.v_start
            ex.vsum += (done - ex.seg_cred) * self._version
            ex.seg_cred = done
        self.paused = False
        self._version = version
        self._reschedule()
