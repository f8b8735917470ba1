"""How executions flow through engines on the real backend: requests out, results booked, faults survived.

What it models: each live execution is a loop of requests (a segment to its engine, a call to the tool
service, gyre.real.tools) whose results advance its episode (gyre.real.execution). Booking a result may start the
next request, finish the execution, move it at a tool-call boundary (a migration: the target re-prefills
its context), or, when the engine actor died, move it to another engine from its last tool-call boundary
(the segment in flight is regenerated; nothing of it was recorded) while a replacement actor starts on the
same GPUs. Handle completions are only queued here (`_deferred`); the run loop releases them.

`ExecutionFlow` is a mixin of gyre.real.backend.RealCluster and uses its bookkeeping (`_engines`, `_log`,
`_submit`, `_busy`, `_wake`, `_publish`, `_published`, `pool`, `profile`, `cfg`).

A replacement engine is ready only once it serves the latest version: a step that ended during its restart is
loaded first (docs/real.md, Faults).

Simplifications: a dead engine is noticed on its next failed call (or the probe `kill_engine` sends); a
released KV cache on a dead engine is not retried.
"""

from __future__ import annotations

import numpy as np
import ray

from gyre.backend import PARK
from gyre.engine_lifecycle import READY, RESTARTING
from gyre.cluster import ClusterError, Phase
from gyre.real.execution import RealExecution
from gyre.real.task_api import Done, Tool
from gyre.real.engine_view import RealEngine


class ExecutionFlow:
    # --- the execution loop: issue a request, book its result ---
    def _start_queued(self, eng: RealEngine) -> None:
        while eng.queue and eng.ready and eng.fits(eng.queue[0].group.prompt_tokens):
            ex = eng.queue.popleft()
            action = ex.start(self.now)
            self._log(("start", self.now, ex.id, eng.id))
            self._issue(ex, action)

    def _issue(self, ex: RealExecution, action) -> None:
        if ex.phase == Phase.PARKED:  # its tool returned while parked: the next request waits for resume
            ex.pending = action
            return
        ex.req = getattr(ex, "req", 0) + 1
        req, eng = ex.req, ex.engine
        ex.inflight = action
        if isinstance(action, Done):
            self._finish(ex, action.truncated, action.end)
            return
        if isinstance(action, Tool):
            ex.phase = Phase.TOOL
            if ex.migrate_to is not None:
                self._do_migrate(ex)
            self._busy(eng)
            ex.tool_t0 = self.now
            self.tools.call(action.call, lambda out: self._on_tool(ex, req, out))
            return
        if ex.migrate_to is not None:  # between segments: a boundary
            self._do_migrate(ex)
            if ex.phase == Phase.PARKED:
                ex.pending = action
                return
            eng = ex.engine
        if not eng.ready:  # its engine is restarting: re-issued when it is back
            ex.phase = Phase.PREFILL
            ex.lost = True
            return
        ex.phase = Phase.DECODE
        self._busy(eng)
        seed = int(np.random.default_rng([self.cfg.seed, ex.id, ex.generated, ex.turns, req]).integers(2**62))
        actor = eng.actor
        ex.gen_t0, ex.gen_batch = self.now, eng.n_decoding
        if action.parallel:
            self._issue_parallel(ex, req, eng, actor, action, seed)
            return
        ref = actor.generate.remote(action.seq, action.context, action.max_new, self.task.stop, seed)
        self._submit(ref, lambda res, err: self._on_generated(ex, req, eng, actor, res, err))

    def _issue_parallel(self, ex, req, eng, actor, action, seed: int) -> None:
        """A Generate with parallel segments: each is its own engine request (the engine batches them), sent at once;
        the first error, or the last answer (each stamped with when it came back), is booked as one result."""
        segs = (action, *action.parallel)
        got: list = [None] * len(segs)
        over = [False]

        def back(i: int, res, err) -> None:
            if over[0]:
                return
            if err is not None:
                over[0] = True
                self._on_generated(ex, req, eng, actor, None, err)
                return
            got[i] = {**res, "done": self.now}
            if all(g is not None for g in got):
                over[0] = True
                both = {**got[0], "cancelled": any(g.get("cancelled") for g in got), "parallel": got,
                        "prefill_tokens": sum(g.get("prefill_tokens", 0) for g in got),
                        "prefill_s": max(g.get("prefill_s", 0.0) for g in got)}
                self._on_generated(ex, req, eng, actor, both, None)

        for i, g in enumerate(segs):
            ref = actor.generate.remote(g.seq, g.context, g.max_new, self.task.stop, seed + i)
            self._submit(ref, lambda res, err, i=i: back(i, res, err))

    def _on_generated(self, ex, req, eng, actor, res, err) -> None:
        if err is not None:
            if isinstance(err, ray.exceptions.RayActorError):
                self._on_engine_dead(eng, actor)
                return
            raise err
        if req != ex.req or res.get("cancelled"):
            return
        self.profile["requests"].append((res["prefill_tokens"], len(res["tokens"]), ex.gen_batch, self.now - ex.gen_t0))
        if getattr(ex, "migrated_at", None) is not None:
            self.profile["migration"].append((res["prefill_tokens"], res["prefill_s"], self.now - ex.migrated_at))
            ex.migrated_at = None
        if "parallel" in res:
            action = ex.on_generated_all([(g["tokens"], g["logprobs"], g["version"], g["done"]) for g in res["parallel"]],
                                         self.now)
        else:
            action = ex.on_generated(res["tokens"], res["logprobs"], res["version"], self.now)
        self._issue(ex, action)
        self._busy(eng)

    def _on_tool(self, ex, req, out) -> None:
        if req != ex.req:
            return
        if ex.segs:  # a task may open with a tool call (gyre.real.tasks.harness: launching its harness)
            ex.segs[-1]["tool_s"] = self.now - ex.tool_t0
        self._issue(ex, ex.on_tool(out, self.now))

    def _finish(self, ex: RealExecution, truncated: bool, end: int) -> None:
        eng = ex.engine
        del eng.members[ex.id]
        ex.engine = None
        ex.phase = Phase.DONE
        ex.finished_at, ex.truncated = self.now, truncated
        self._background += [eng.actor.release.remote(q) for q in ex.seq_ids]
        self._log(("finish", self.now, ex.id, end, ex.generated))
        self._log(("note", self.now, "reward", {"exec": ex.id, "group": ex.group_id, "reward": ex.reward,
                                                 "truncated": truncated, "turns": ex.turns}))
        if ex.group.done:  # its last episode: the group is scored on the tool workers, beside the rollouts
            self.verifier.start(ex.group)
        self._deferred.append((ex.handle, ex))
        if ex.migrate_handle is not None:
            self._deferred.append((ex.migrate_handle, False))
            ex.migrate_to = ex.migrate_handle = None
        self._busy(eng)
        self._start_queued(eng)

    def _move(self, ex: RealExecution, dst: RealEngine) -> None:
        src = ex.engine
        del src.members[ex.id]
        ex.engine = dst
        dst.members[ex.id] = ex
        if ex.phase == Phase.QUEUED:
            src.queue.remove(ex)
            dst.queue.append(ex)
        else:
            ex.migrated_at = self.now
            if src.ready:
                self._background += [src.actor.release.remote(q) for q in ex.seq_ids]
        self._log(("migrate", self.now, ex.id, src.id, dst.id))
        self._busy(src)
        self._start_queued(src)

    def _do_migrate(self, ex: RealExecution, inflight: bool = False) -> None:
        """Carry out ex's pending migration at a boundary, or, `inflight` (the policy asked while it decodes, with
        cfg.move_in_flight: RealCluster._migrate_now), with its engine request cancelled and re-issued."""
        dst, h = ex.migrate_to, ex.migrate_handle
        ex.migrate_to = ex.migrate_handle = None
        if inflight:  # the engine request is abandoned at the source (its late answer is ignored: `req` moves on)
            for g in (ex.inflight, *ex.inflight.parallel):
                self._background.append(ex.engine.actor.cancel.remote(g.seq))
            ex.req += 1
            ex.moved_requests = getattr(ex, "moved_requests", 0) + 1
            self._log(("note", self.now, "request_moved", {"exec": ex.id, "from": ex.engine.id,
                                                            "to": None if dst is PARK else dst.id}))
        if dst is PARK:
            if inflight:
                ex.pending = ex.inflight  # re-issued where it resumes
            self._park(ex)
        else:
            self._move(ex, dst)
            if inflight:
                self._issue(ex, ex.inflight)  # re-prefilled at the destination
            self._start_queued(dst)
        self._deferred.append((h, True))

    def _park(self, ex: RealExecution) -> None:
        """Off its engine at a boundary: a waiting execution leaves the queue, a started one's KV is released."""
        src = ex.engine
        del src.members[ex.id]
        ex.engine = None
        if ex.phase == Phase.QUEUED:
            src.queue.remove(ex)
        elif src.ready:
            self._background += [src.actor.release.remote(q) for q in ex.seq_ids]
        ex.parked_phase, ex.phase = ex.phase, Phase.PARKED
        self._log(("park", self.now, ex.id, src.id))
        self._busy(src)
        self._start_queued(src)

    def _resume_now(self, ex: RealExecution, dst: RealEngine) -> None:
        """Back on an engine: a waiting one queues there; a started one re-prefills with its next request."""
        ex.engine = dst
        dst.members[ex.id] = ex
        ex.phase = ex.parked_phase
        if ex.phase == Phase.QUEUED:
            dst.queue.append(ex)
            self._start_queued(dst)
            return
        ex.migrated_at = self.now
        pending, ex.pending = getattr(ex, "pending", None), None
        if pending is not None:
            self._issue(ex, pending)
        self._busy(dst)

    def _on_engine_dead(self, eng: RealEngine, actor) -> None:
        if eng.actor is not actor or eng.state is not READY:
            return  # already handled
        eng.transition(RESTARTING, self._published)  # it comes back serving at least this version (_on_respawned)
        eng.fault_t = self.now
        others = [e for e in self._engines.values() if e.ready and e is not eng]
        self._log(("note", self.now, "engine_fault", {"engine": eng.id, "executions": sorted(eng.members),
                                                       "moved": len(eng.members) if others else 0}))
        for ex in sorted(eng.members.values(), key=lambda x: x.id):
            lost = ex.phase == Phase.DECODE
            ex.phase = Phase.PREFILL if lost else ex.phase
            if others:
                self._move(ex, min(others, key=lambda e: (e.n_live, e.id)))
            if lost:
                ex.lost = True
        for e in others:
            self._start_queued(e)
            self._resume_lost(e)
        self._busy(eng)
        self._respawn_engine(eng)

    def kill_engine(self, engine_id: int) -> None:
        """Kill the actor behind a running engine (fault injection); the run must survive it. The driver
        finds it dead through a liveness probe (`ping`), as it would through any other failed call."""
        eng = self._engines.get(engine_id)
        if eng is None or not eng.ready:
            raise ClusterError(f"kill_engine: engine {engine_id} is not running")
        actor = eng.actor
        ray.kill(actor, no_restart=True)

        def probed(_v, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):
                self._on_engine_dead(eng, actor)

        self._submit(actor.ping.remote(), probed)

    def _respawn_engine(self, eng: RealEngine) -> None:
        """A fresh actor on the dead one's GPUs, woken with the latest weights."""
        eng.actor = self.pool.respawn(eng.gpus)
        v, actor = self._published, eng.actor
        self._wake(eng, v, lambda dt, err: self._on_respawned(eng, actor, v, err))

    def _resume_lost(self, eng: RealEngine) -> None:
        for ex in sorted(eng.members.values(), key=lambda x: x.id):
            if getattr(ex, "lost", False) and ex.phase != Phase.TOOL:
                ex.lost = False
                self._issue(ex, ex.inflight)

    def _on_respawned(self, eng: RealEngine, actor, version: int, err) -> None:
        """The replacement woke with `version`; it is ready only once it serves the latest version.

        A step that ended during the restart published a newer version, which `sync` did not send to a
        restarting engine: it is loaded here first, so a ready engine never serves older weights than the
        version it reported while restarting (the latest)."""
        if err is not None:
            if isinstance(err, ray.exceptions.RayActorError) and eng.actor is actor:
                self._log(("note", self.now, "engine_fault", {"engine": eng.id, "executions": []}))
                self._respawn_engine(eng)  # the replacement died too: another one
                return
            raise ClusterError(f"engine {eng.id}: replacement actor failed to start: {err}")
        if eng.actor is not actor:
            return
        if version < self._published and eng.stop_after_restart is None:
            v = self._published

            def loaded(_dt, err2) -> None:
                if err2 is None:
                    self._log(("sync", self.now, eng.id, v))
                self._on_respawned(eng, actor, v, err2)

            self._publish([eng], lambda e: loaded)
            return
        eng.transition(READY, version)
        self._log(("note", self.now, "engine_restarted", {"engine": eng.id, "version": version,
                                                           "recovery_s": self.now - eng.fault_t}))
        if eng.stop_after_restart is not None:
            h, eng.stop_after_restart = eng.stop_after_restart, None
            self._stop(eng, h)
            return
        self._resume_lost(eng)
        self._start_queued(eng)
