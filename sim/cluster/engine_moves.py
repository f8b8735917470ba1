"""Executions moving on and off a simulated engine, and the engine losing its process or its weights.

A mixin of SimEngine (gyre.sim.cluster.engine), kept apart from the engine's event loop: what the cluster does to
an engine from outside (gyre.sim.cluster.backend): a migration takes a between-turns execution off one engine
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
    from gyre.sim.cluster.execution import SimExecution

_TOOL, _DECODE, _QUEUED = Phase.TOOL, Phase.DECODE, Phase.QUEUED


class EngineMoves:
    """Needs from the engine: cluster, members, queue, prefill, _heap, _ready, _adm, _seq, V, kv (its KvLedger),
    paused, _version, _full, _st, _log, advance(), _used(), _drop(), _admitted(), _drain_queue(), _touch(),
    _reschedule()."""

    __slots__ = ()

    def remove(self, ex: SimExecution) -> int:
        """Take a non-decoding execution off this engine (migration); a pending tool call leaves with it.
        Returns the KV tokens it held here (now freed)."""
        kv = ex.resident
        self.advance(self.cluster.now)
        if ex.ready_at is not None:
            self._ready = [x for x in self._ready if x[2] is not ex]
            heapq.heapify(self._ready)
        self._drop(ex)
        self._drain_queue(self.cluster.now)
        self._touch(self.cluster.now)
        return kv

    def add_migrated(self, ex: SimExecution, t: float, transferred: int = 0) -> None:
        """Take an execution that is between turns (or waiting) from another engine, or off none (parked, or
        its engine crashed). `transferred` KV tokens of its context arrive with it: resident if they fit here,
        otherwise (and with none) it re-prefills."""
        self.advance(t)
        ex.engine = self
        self.members[ex.id] = ex
        if transferred and self._used() + transferred + self._st + self.kv.n_dec + 1 <= self._full:
            self.kv.arrive(ex, transferred)
            self._admitted(ex)
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
        self.advance(t)
        if self.kv.n_dec:
            self._log(("busy", t, self.id, 0))
        out = sorted(self.members.values(), key=lambda x: x.id)
        lost = 0.0
        for ex in out:
            lost += ex.seg_done + (self.V - ex.v_start if ex.phase == _DECODE else 0.0)
            ex.ctx = ex.kv[ex.seg]
            ex.seg_done = 0.0
            ex.phase = _TOOL if ex.ready_at is not None else _QUEUED
            ex.adm = -1
            ex.engine = None
        self.kv.wipe(out)
        self.members = {}
        self.queue.clear()
        self.prefill.clear()
        self._heap, self._ready, self._adm = [], [], []
        self.paused = False
        self._reschedule()  # nothing left to plan: invalidates the pending wakeup
        return out, lost

    # --- weights ---
    def pause(self, t: float) -> None:
        """A weight load starts: decoding stops."""
        self.advance(t)
        self.paused = True
        self._reschedule()

    def resume(self, t: float, version: int) -> None:
        """The load is done: decoding goes on at `version`; the tokens decoded so far in each current segment
        were the old version's."""
        self.advance(t)
        for _, _, ex in self._heap:
            done = ex.seg_done + self.V - ex.v_start
            ex.vsum += (done - ex.seg_cred) * self._version
            ex.seg_cred = done
        self.paused = False
        self.serve(version)
        self._reschedule()

    def restarted(self, t: float) -> None:
        """Its process is back (ready): the executions that waited for it start."""
        self._drain_queue(t)
        self._touch(t)
