"""The data-parallel training step of the real backend: which trainer workers run a step, and catching up.

A step on GPUs G runs data-parallel on the trainer workers of G (one per GPU, in the GPUs' placement-group
bundles), rank 0 = the lowest GPU. Steps run one after another: a step asked for while one runs starts
when it ends (`_steps`). The driver keeps which version each worker holds (`_held`): the step's rank 0
becomes the worker of record (`_record`, holding version `_tv`), and a worker that missed steps gets the
state of record first.

`TrainSteps` is a mixin of gyre.real.backend.RealCluster and uses its `pool`, `cfg` and `_submit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre.cluster import ClusterError


class TrainSteps:
    def _start_step(self, gpus: tuple[int, ...], batch, end: Callable[[Any, BaseException | None], None]) -> None:
        """Run one step data-parallel on the workers of `gpus`; workers that missed steps catch up first."""
        self._stepping = True
        stale = [g for g in gpus if self._held[g] != self._tv]
        if stale:
            def go(state, err) -> None:
                if err is not None:
                    raise ClusterError(f"train: the state of record could not be read: {err}")
                self._launch_step(gpus, batch, state[0], set(stale), end)

            self._submit(self.pool.trainers[self._record].get_state.remote(), go)
        else:
            self._launch_step(gpus, batch, None, set(), end)

    def _launch_step(self, gpus, batch, state, stale: set[int], end) -> None:
        trainers = self.pool.trainers
        specs = self.pool.book.specs(tuple(f"t{g}" for g in gpus), "dp") if len(gpus) > 1 else [None]
        left, stats0 = [len(gpus)], {}

        def one(rank: int):
            def done(stats, err) -> None:
                if err is not None:
                    if len(gpus) > 1:
                        self.pool.book.broken("dp", tuple(f"t{g}" for g in gpus))
                    raise ClusterError(f"train: rank {rank} (GPU {gpus[rank]}) failed: {err}")
                if rank == 0:
                    stats0.update(stats, caught_up=len(stale))
                left[0] -= 1
                if left[0] == 0:
                    end(stats0, None)
            return done

        for rank, (g, spec) in enumerate(zip(gpus, specs)):
            ref = trainers[g].train.remote(batch, spec, state if g in stale else None,
                                           self.cfg.checkpoint if rank == 0 else None)
            self._submit(ref, one(rank))
