"""The data-parallel training step of the real backend: which workers run a step, catching up, and surviving
the loss of a trainer worker.

A step on GPUs G runs data-parallel on the trainer workers of G (one per GPU, in the GPUs' placement-group
bundles), rank 0 = the lowest GPU. Steps run one after another in the order asked (`_steps`). The driver
keeps which version each worker holds (`_held`, None: unknown): a rank that finishes a step becomes the
worker of record (`_record`, holding version `_tv`), and a worker that missed steps gets the state of record
first.

A trainer worker that dies (its call fails, or the probe of `kill_trainer`) is replaced by a fresh actor
(`ActorPool.respawn_trainer`; the collective store moves with worker 0). What is lost is at most the step in
flight, and only its compute: a step none of whose ranks finished is run again on the same GPUs with the same
batch, so versions continue and every execution's recorded tokens are trained exactly once. When no live
worker holds the state of record any more (its worker died, or it was a rank of the failed step), it is
rebuilt before the next step on the lost record's GPU: from the last checkpoint (`checkpoint_every`), or from
the run's starting weights, then the batches trained since are replayed in order (the driver keeps their
object refs). A replay on one worker equals the data-parallel original to fp32 summation order.

`TrainSteps` is a mixin of gyre.real.backend.RealCluster and uses its `pool`, `cfg`, `_submit`, `_log`, `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from gyre.cluster import ClusterError

Step = tuple[tuple[int, ...], Any, Callable[[dict], None]]  # (GPUs, batch ref, called with the stats)


class TrainSteps:
    def _init_steps(self, base: int, n_workers: int, checkpoint: str | None, every: int) -> None:
        self.base_version = base  # trainer versions count from here in this run
        self._tv = base  # the trainer's version of record
        self._record: int | None = 0  # the trainer worker (= GPU) holding it; None: lost, being rebuilt
        self._held: list[int | None] = [base] * n_workers  # the version each trainer worker holds
        # a sharded (fsdp) trainer: the step group whose shard is all a worker holds (None: the whole state)
        self._shard_of: list[str | None] = [None] * n_workers
        self._steps: deque[Step] = deque()  # asked for, in order; the first runs when `_stepping`
        self._stepping = False
        self._recovering = False
        self._store_pending = False  # trainer worker 0 (the collective store) is being replaced
        self._ckpt_path, self._ckpt_every = checkpoint, every
        self._ckpt_version: int | None = base if base > 0 else None  # the checkpoint's version (None: none)
        # version -> (the batch that made it, its epochs: None the config's, 1 a streaming step), since the checkpoint
        self._batches: dict[int, tuple[Any, int | None]] = {}
        self._lost_at, self._lost_gpu = 0.0, 0
        self._trainer_faults = 0  # trainer workers lost so far
        self._rebuilt: Callable[[], None] | None = None  # to run once the state of record is rebuilt

    # --- the queue ---
    def _enqueue_step(self, gpus: tuple[int, ...], batch, end: Callable[[dict], None]) -> None:
        self._steps.append((gpus, batch, end))
        self._next_step()

    def _next_step(self) -> None:
        if self._stepping or self._recovering or self._store_pending or not self._steps:
            return
        if self._record is None:
            self._recover()
            return
        self._stepping = True
        gpus, batch, end = self._steps[0]
        group = self.pool.book.name_of(tuple(f"t{g}" for g in gpus), "dp") if len(gpus) > 1 else None
        stale = [g for g in gpus if self._held[g] != self._tv or self._shard_of[g] not in (None, group)]
        if not stale:
            self._launch_step(gpus, batch, None, set())
            return
        actor = self.pool.trainers[self._record]

        def go(state, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):
                self._stepping = False
                self._trainer_dead(self._record, actor)
                return
            if err is not None:
                raise ClusterError(f"train: the state of record could not be read: {err}")
            self._launch_step(gpus, batch, state[0], set(stale))

        self._submit(actor.get_state.remote(), go)

    def _launch_step(self, gpus, batch, state, stale: set[int]) -> None:
        v = self._tv + 1
        every = self._ckpt_every
        save = self._ckpt_path if self._ckpt_path and every and (v - self.base_version) % every == 0 else None
        if hasattr(batch, "launch"):  # a streaming step's end (gyre.real.streaming): the reduction into the core
            batch.launch(state, stale, save)
            return
        trainers = self.pool.trainers
        members = tuple(f"t{g}" for g in gpus)
        specs = self.pool.book.specs(members, "dp") if len(gpus) > 1 else [None]
        left, ok, errors, died = [len(gpus)], {}, [], []
        faults_before = self._trainer_faults

        def one(rank: int, actor):
            def done(stats, err) -> None:
                if err is None:
                    ok[rank] = stats
                else:
                    errors.append(f"rank {rank} (GPU {gpus[rank]}): {str(err).splitlines()[0][:160]}")
                    if isinstance(err, ray.exceptions.RayActorError):
                        died.append(rank)
                        self._trainer_dead(gpus[rank], actor)
                        if not ok:  # the others wait for it in the all-reduce until the group's timeout: end them
                            for r, (g, a) in enumerate(zip(gpus, ranks)):
                                if r not in ok and r != rank and self.pool.trainers[g] is a:
                                    ray.kill(a, no_restart=True)
                left[0] -= 1
                if left[0] == 0:
                    # a rank may fail for a worker lost elsewhere (worker 0's store): retried as well
                    lost = bool(died) or self._trainer_faults != faults_before
                    self._step_ended(gpus, batch, ok, errors, lost, save, len(stale))
            return done

        ranks = [trainers[g] for g in gpus]
        for rank, (g, spec) in enumerate(zip(gpus, specs)):
            ref = trainers[g].train.remote(batch, spec, state if g in stale else None, save if rank == 0 else None)
            self._submit(ref, one(rank, trainers[g]))

    def _step_ended(self, gpus, batch, ok: dict[int, dict], errors: list[str], died: bool, save: str | None,
                    caught_up: int) -> None:
        self._stepping = False
        whole = [r for r in ok if ok[r].get("shard_of") is None]  # (sharded: only rank 0 holds the whole state)
        if whole:  # replicas: any rank that finished holds the new version
            first = min(whole)
            stats = {**ok[first], "caught_up": caught_up}
            self._tv, self._record = stats["version"], gpus[first]
            for rank, g in enumerate(gpus):
                self._held[g] = self._tv if rank in ok else None
                self._shard_of[g] = ok[rank].get("shard_of") if rank in ok else None
            if errors and len(gpus) > 1:  # the ranks left out re-form with the others: a fresh group
                self.pool.book.broken("dp", tuple(f"t{g}" for g in gpus))
            self._batches[self._tv] = (batch, None)
            if save and 0 in ok:
                self._ckpt_version = self._tv
                self._batches = {v: b for v, b in self._batches.items() if v > self._tv}
            if errors:
                self._log(("note", self.now, "step_partial", {"version": self._tv, "errors": errors}))
            self._stepping = True  # until its snapshot exists
            self._publish_step(stats)
            return
        if len(gpus) > 1:
            self.pool.book.broken("dp", tuple(f"t{g}" for g in gpus))
        if not died:  # no worker was lost meanwhile: a genuine error
            raise ClusterError(f"train: step {self._tv + 1} failed: {'; '.join(errors)}")
        for g in gpus:  # mid-step state: unknown
            self._held[g], self._shard_of[g] = None, None
        if self._record in gpus:
            self._lose_record(self._record)
        self._log(("note", self.now, "step_retry", {"version": self._tv + 1, "gpus": list(gpus), "errors": errors}))
        self._next_step()

    def _stream_ended(self, core: tuple[int, ...], first: int, stats: dict, save: str | None, batch) -> None:
        """A streaming step's core stepped (gyre.real.streaming): its workers `core` (those still alive) hold the new
        state of record (none: it is rebuilt on `first`'s GPU); its batch replays as one optimizer step."""
        self._stepping = False
        self._tv = stats["version"]
        for g in core:
            self._held[g], self._shard_of[g] = self._tv, None
        if core:
            self._record = core[0]
        else:
            self._lose_record(first)
        self._batches[self._tv] = (batch, 1)
        if save:
            self._ckpt_version = self._tv
            self._batches = {v: b for v, b in self._batches.items() if v > self._tv}
        self._stepping = True  # until its snapshot exists
        self._publish_step(stats)

    def _when_record(self, fn: Callable[[], None]) -> None:
        """Call `fn` once a worker holds the state of record (now, or once it is rebuilt: checkpoint and replay)."""
        if self._record is not None and not self._recovering and not self._store_pending:
            fn()
            return
        if self._record is None and not self._recovering and not self._store_pending and not self._stepping:
            self._recover()
        self._call_after(0.05, lambda: self._when_record(fn))

    def _publish_step(self, stats: dict) -> None:
        """Make the new version's snapshot (an object the driver owns, so it outlives the worker), then book
        the step. If the worker of record dies first, another holder (or the rebuilt state) makes it."""
        if self._record is None:  # rebuilt first; _recover calls back
            self._stepping = False
            self._rebuilt = lambda: self._publish_step(stats)
            self._next_step()
            return
        gpu = self._record
        actor = self.pool.trainers[gpu]
        ref, ack = actor.publish.remote(self._tv)  # the driver waits on `ack`: the weights stay in the object store

        def made(_v, err) -> None:
            if isinstance(err, ray.exceptions.RayActorError):
                self._trainer_dead(gpu, actor)
                self._publish_step(stats)
                return
            if err is not None:
                raise ClusterError(f"train: the snapshot of version {self._tv} could not be made: {err}")
            if (self._tv - self.base_version) % self.steps_per_burst == 0:  # a burst's last step: engines may load it
                self._weights = ref
            self._stepping = False
            _, _, end = self._steps.popleft()
            end(stats)
            self._next_step()

        self._submit(ack, made)

    # --- losing a worker ---
    def kill_trainer(self, gpu: int) -> None:
        """Kill trainer worker `gpu` (fault injection); a liveness probe (`ping`) finds it dead."""
        actor = self.pool.trainers[gpu]
        ray.kill(actor, no_restart=True)
        self._submit(actor.ping.remote(), lambda _v, err: err is not None and self._trainer_dead(gpu, actor))

    def _trainer_dead(self, gpu: int, actor) -> None:
        """Worker `gpu`'s actor died: replace it; if it held the only state of record, rebuild that."""
        if self.pool.trainers[gpu] is not actor:
            return  # already replaced
        self._trainer_faults += 1
        if self._record is not None:
            self._lost_at = self.now  # the incident starts (a rebuild's recovery_s counts from here)
        self._log(("note", self.now, "trainer_fault", {"worker": gpu, "version": self._tv,
                                                       "in_step": self._stepping, "record": gpu == self._record}))
        self.pool.respawn_trainer(gpu)
        self._held[gpu], self._shard_of[gpu] = None, None
        if gpu == 0:  # it served the collective store: the replacement serves a new one
            self._store_pending = True
            server = self.pool.trainers[0]

            def served(addr, err) -> None:
                if isinstance(err, ray.exceptions.RayActorError):  # the replacement died too: its own serves
                    self._trainer_dead(0, server)
                    return
                if err is not None:
                    raise ClusterError(f"trainer worker 0: the replacement could not serve the store: {err}")
                self.pool.book.new_store(tuple(addr))
                self._store_pending = False
                self._next_step()

            self._submit(self.pool.serve_store(), served)
        if gpu == self._record:
            self._lose_record(gpu)
        if self._step is not None:  # a cell of the open streaming step loses what it accumulated
            self._step.worker_lost(gpu)
        self._next_step()

    def _lose_record(self, gpu: int) -> None:
        holders = [g for g, v in enumerate(self._held) if v == self._tv and g != gpu and self._shard_of[g] is None]
        self._record = holders[0] if holders else None
        self._lost_gpu = gpu

    def _recover(self) -> None:
        """Rebuild the state of record on the lost record's GPU: checkpoint (or starting weights) + replay."""
        self._recovering = True
        gpu, actor = self._lost_gpu, self.pool.trainers[self._lost_gpu]
        restore = actor.load.remote(self._ckpt_path) if self._ckpt_version is not None else \
            actor.reset.remote(self.cfg.seed)
        failed = [False]

        def lost(err) -> bool:
            if failed[0]:
                return True  # this attempt failed already
            if isinstance(err, ray.exceptions.RayActorError):
                failed[0], self._recovering = True, False
                self._trainer_dead(gpu, actor)
                return True
            if err is not None:
                raise ClusterError(f"trainer: the state of record could not be rebuilt: {err}")
            return False

        def restored(version, err) -> None:
            if lost(err):
                return
            start = version if self._ckpt_version is not None else self.base_version
            if start > self._tv:  # written by a step that did not stand: the state before it is gone
                raise ClusterError(f"trainer: checkpoint {self._ckpt_path} holds version {start}, the run's state "
                                   f"of record is {self._tv}")
            replay = [self._batches[v] for v in range(start + 1, self._tv + 1)]
            refs = [actor.train.remote(b, None, None, None, e) for b, e in replay] or [actor.ping.remote()]
            left = [len(refs)]

            def replayed(_v, err2) -> None:
                if lost(err2):
                    return
                left[0] -= 1
                if left[0] == 0:
                    self._recovering = False
                    self._record = gpu
                    self._held[gpu], self._shard_of[gpu] = self._tv, None
                    self._log(("note", self.now, "trainer_recovered", {
                        "worker": gpu, "version": self._tv, "from_version": start, "replayed": len(replay),
                        "recovery_s": self.now - self._lost_at}))
                    then, self._rebuilt = self._rebuilt, None
                    if then is not None:  # a step whose snapshot was lost with its worker
                        self._stepping = True
                        then()
                        return
                    self._next_step()

            for ref in refs:
                self._submit(ref, replayed)

        self._submit(restore, restored)
