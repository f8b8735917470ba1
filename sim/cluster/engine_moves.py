"""What the cluster does to a simulated engine from outside its event loop: executions joining and leaving it,
the engine losing its process or its weights.

Plain functions over a gyre.sim.cluster.engine.SimEngine, through its public members and methods (its queues, its
KvLedger `kv` for the books, its KvPressure `pressure` for who starts): an admission gives a fresh execution to
an engine (`admit`); a migration takes a between-turns execution off one engine (`remove`) and gives it to
another (`add_migrated`: its KV arrives resident if it was transferred and fits, otherwise it re-prefills there);
a decoding execution's in-flight model request is cancelled, leaving it between turns with the context
before its segment resident (`cancel_request`, a migration with move_at="request"); a crash loses every member's
unfinished segment (`wipe`); a weight sync pauses decoding and resumes it at the
new version, crediting the tokens decoded so far to the old one (`pause`, `resume_decoding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.cluster import Phase
from gyre.sim.cluster.time_heap import heapify

if TYPE_CHECKING:
    from gyre.sim.cluster.engine import SimEngine
    from gyre.sim.cluster.execution import SimExecution

_DECODE = Phase.DECODE


def admit(engine: SimEngine, ex: SimExecution, t: float) -> None:
    """A fresh execution (it holds no KV) joins: it waits for its first request (request_s), or for KV."""
    engine.advance(t)
    ex.engine = engine
    engine.members[ex.id] = ex
    ex.ctx = ex.kv[0]
    req = engine.costs.request_s
    if req:  # its first request is on its way to the engine
        ex.ready_at = t + req
    _await_turn(engine, ex, t)


def _await_turn(engine: SimEngine, ex: SimExecution, t: float) -> None:
    """A member that just arrived waits for its pending tool call or request (`ready_at`), else queues to run."""
    if ex.ready_at is not None:
        ex.await_tool()
        engine.start_timer(ex, ex.ready_at)
    else:
        ex.wait()
        engine.queue.append(ex)
        engine.pressure.start_queued(t)
    engine.touch(t)


def remove(engine: SimEngine, ex: SimExecution) -> int:
    """Take a non-decoding execution off the engine (migration); a pending tool call leaves with it.
    Returns the KV tokens it held there (now freed)."""
    kv = ex.resident
    t = engine.cluster.now
    engine.advance(t)
    if ex.ready_at is not None:  # its pending tool call leaves with it
        engine.timers = [x for x in engine.timers if x[2] is not ex]
        heapify(engine.timers)
    engine.drop(ex)
    engine.pressure.start_queued(t)
    engine.touch(t)
    return kv


def cancel_request(engine: SimEngine, ex: SimExecution, t: float) -> tuple[float, float]:
    """Cancel the in-flight request of a decoding execution at t (move_at="request"): it leaves the decode batch and
    its current segment is discarded, the tokens decoded before a preemption included (the request is retried
    elsewhere, so its output is generated again; the trajectory records the retried request's). Its version
    credit is again what its kept tokens earned (SimExecution.drop_segment_credit). It stays a member, waiting,
    with the context before the segment resident (what a KV read takes; `remove` frees it). Returns (the tokens
    discarded, the GPU-seconds they took: each its share of a decode step of the batch it left, the step as the
    cost model prices the batch and context now, times the engine's GPUs)."""
    engine.advance(t)
    kv = engine.kv
    n = kv.n_dec
    tokens = ex.seg_done + (engine.V - ex.v_start)
    gpu_s = tokens * engine.costs.step_time(n, kv.kv_dec_base + n * engine.V) / n * len(engine.gpus)
    batch = engine.batch
    batch[:] = [x for x in batch if x[2] is not ex]
    heapify(batch)
    kv.leave_decode(ex)
    if kv.n_dec == 0:
        engine.cluster.log.append(("busy", t, engine.id, 0))
    ex.drop_segment_credit()
    ex.ctx = ex.kv[ex.seg]
    kv.cache(ex, ex.ctx)
    ex.await_tool()  # between turns: neither queued nor in the prefill queue (remove takes it off next)
    engine.touch(t)
    return tokens, gpu_s


def add_migrated(engine: SimEngine, ex: SimExecution, t: float, transferred: int = 0) -> None:
    """Give the engine an execution that is between turns (or waiting) from another engine, or off none (parked,
    or its engine crashed). `transferred` KV tokens of its context arrive with it: resident if they fit here,
    otherwise (and with none) it re-prefills."""
    engine.advance(t)
    ex.engine = engine
    engine.members[ex.id] = ex
    kv = engine.kv
    if transferred and kv.used(engine.V) + transferred + engine.costs.state_tokens + kv.n_dec + 1 \
            <= engine.pressure.full:
        kv.arrive(ex, transferred)
        engine.pressure.admitted(ex)
    _await_turn(engine, ex, t)


def wipe(engine: SimEngine, t: float) -> tuple[list[SimExecution], float]:
    """The engine's process died at t: every member leaves it, in id order, holding no KV. The unfinished part
    of a segment (decoding, or kept by a preemption) is lost and decoded again (nothing of it was recorded); a
    tool call keeps running. Returns the members, detached, and the decoded tokens lost."""
    engine.advance(t)
    if engine.kv.n_dec:
        engine.cluster.log.append(("busy", t, engine.id, 0))
    out = sorted(engine.members.values(), key=lambda x: x.id)
    lost = 0.0
    V = engine.V
    for ex in out:
        lost += ex.seg_done + (V - ex.v_start if ex.phase == _DECODE else 0.0)
        ex.ctx = ex.kv[ex.seg]
        ex.seg_done = 0.0
        if ex.ready_at is not None:
            ex.await_tool()
        else:
            ex.wait()
        ex.adm = -1
        ex.engine = None
    engine.kv.wipe(out)
    engine.clear()
    engine.replan(t)  # nothing left to plan: invalidates the pending wakeup
    return out, lost


def pause(engine: SimEngine, t: float) -> None:
    """A weight load starts: decoding stops."""
    engine.advance(t)
    engine.paused = True
    engine.replan(t)


def resume_decoding(engine: SimEngine, t: float, version: int) -> None:
    """The load is done: decoding goes on at `version`; the tokens decoded so far in each current segment were
    the old version's."""
    engine.advance(t)
    V, old = engine.V, engine.version
    for _, _, ex in engine.batch:
        ex.credit_decoded(ex.seg_done + V - ex.v_start, old)
    engine.paused = False
    engine.serve(version)
    engine.replan(t)


def restarted(engine: SimEngine, t: float) -> None:
    """Its process is back (ready): the executions that waited for it start."""
    engine.pressure.start_queued(t)
    engine.touch(t)
