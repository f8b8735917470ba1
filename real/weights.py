"""Weight publishing on the real backend: how engines get the latest published policy version (with bursts,
`steps_per_burst` = mu, the last multiple of mu; the trainer may be up to mu - 1 versions ahead).

`RealClusterConfig.weight_sync` chooses the route. "object_store": each version is one Ray object
reference, the worker of record's snapshot, made once per version, that engines load in their `wake` or
`load_weights` call. "collective": the worker of record broadcasts it to the engines being woken or synced
over a standalone group (gyre.real.collective), falling back to the object store for an engine whose
broadcast failed (a peer died), on NCCL for the engine sharing the sender's GPU, and for every engine while a
lost trainer worker is replaced (the driver keeps the latest version's object ref for that).

`WeightPublisher` is a mixin of gyre.real.backend.RealCluster and uses its `pool`, `cfg`, `_submit`,
`_log`, `_call_after`, `_engines`, `_published`, `_tv`, `base_version`, `_record` and `_store_pending`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from gyre.real.collective import plan_broadcast
from gyre.faults import SYNC_TIMEOUT_S
from gyre.real.engine_view import RealEngine


class WeightPublisher:
    def _weights_ref(self):
        """The object ref of the latest weights (the worker of record's snapshot), made once per version."""
        return self._weights  # made by the step that published it, before the version was booked

    def _wake(self, eng: RealEngine, v: int, done: Callable[[Any, BaseException | None], None]) -> None:
        """Wake the engine's actor with version `v` (the latest): in the call, or by a broadcast after it."""
        actor = eng.actor
        if self.cfg.weight_sync == "object_store":
            self._submit(actor.wake.remote(self._weights_ref(), v), done)
            return

        def woken(_dt, err) -> None:
            if err is not None:
                done(None, err)
            else:
                self._publish([eng], lambda e: done)

        self._submit(actor.wake.remote(None, v), woken)

    def _publish(self, engines: list[RealEngine], done_for: Callable[[RealEngine], Callable]) -> None:
        """Load the latest version into awake engines; `done_for(e)(seconds, error)` when each has it."""
        pool, v = self.pool, self._published
        # a burst's published version may be older than the trainer's latest, which is all a worker broadcasts
        if self.cfg.weight_sync == "object_store" or self._record is None or self._store_pending or \
                self._tv - self.base_version != v:
            for e in engines:
                self._submit(e.actor.load_weights.remote(self._weights_ref(), v), done_for(e))
            return
        src = self._record
        by_slot = {pool.slot(e.gpus): e for e in engines}
        coll, store = plan_broadcast(pool.slot((src,)), sorted(by_slot), pool.cfg.collective.backend)
        for s in store:
            e = by_slot[s]
            self._submit(e.actor.load_weights.remote(self._weights_ref(), v), done_for(e))
        if not coll:
            return
        targets = [by_slot[s] for s in coll]
        members = (f"t{src}",) + tuple(pool.member(e.gpus) for e in targets)
        specs = pool.book.specs(members, "sync")

        def sent(_dt, err) -> None:
            if err is not None:
                pool.book.broken("sync", members)

        def received(e: RealEngine, actor):
            def cb(dt, err) -> None:
                if err is None or isinstance(err, ray.exceptions.RayActorError):
                    done_for(e)(dt, err)  # this engine has it, or died (its caller handles that)
                    return
                pool.book.broken("sync", members)  # a peer failed: this one takes the object store
                self._log(("note", self.now, "weights_fallback", {"engine": e.id, "error": str(err)[:200]}))
                self._submit(actor.load_weights.remote(self._weights_ref(), self._published), done_for(e))
            return cb

        self._submit(pool.trainers[src].send_weights.remote(specs[0], self._tv), sent)
        for e, spec in zip(targets, specs[1:]):
            self._submit(e.actor.receive_weights.remote(spec, v), received(e, e.actor))

    def _publish_each(self, engines: list[RealEngine], one, drop: int | None) -> None:
        """Send each engine the latest weights; a load without a reply after SYNC_TIMEOUT_S is sent again (the
        engine `drop` never gets the first message: an injected fault)."""
        for e in engines:
            answered, done = [False], one(e)

            def reply(dt, err, answered=answered, done=done) -> None:
                if not answered[0]:
                    answered[0] = True
                    done(dt, err)

            def resend(e=e, answered=answered, reply=reply) -> None:
                if not answered[0] and self._engines.get(e.id) is e and e.ready:
                    self._log(("note", self.now, "sync_resent", {"engine": e.id, "version": self._published}))
                    self._publish([e], lambda _e: reply)
                    self._call_after(SYNC_TIMEOUT_S, resend)
                elif not answered[0]:
                    reply(0.0, None)  # it died or stopped meanwhile: it wakes with the latest

            if e.id != drop:
                self._publish([e], lambda _e, reply=reply: reply)
            self._call_after(SYNC_TIMEOUT_S, resend)
