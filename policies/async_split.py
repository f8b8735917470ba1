"""Async: a fixed split. R GPUs always generate, the other N - R always train. Generation never stops;
the trainer takes a batch when one is ready (policies.common.Batcher enforces staleness <= eta by
admission control), then engines receive the new weights in place.

R defaults to every GPU the trainer does not need. A fair comparison needs async at its best split and
staleness bound, so its sweep grid (`grid`) tries R leaving the trainer 1x, 2x and N/4 of the GPUs it needs,
times each eta given.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster, ClusterError
from gyre.handles import all_of, any_of
from gyre.policies.common import Batcher, ClusterShape, engine_slots, spread


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    rollout_gpus: int | None = None  # R; None: every GPU the trainer does not need
    eta: int = 1  # staleness bound

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"async: eta must be >= 0, got {self.eta}")


class AsyncSplit:
    name = "async"
    Config = AsyncConfig
    baseline = True  # results are reported as speedups over it

    def __init__(self, config: AsyncConfig | None = None, **params) -> None:
        self.config = config if config is not None else AsyncConfig(**params)
        self.rollout_gpus = self.config.rollout_gpus
        self.eta = self.config.eta

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        n, per, need = shape.n_gpus, shape.gpus_per_engine, shape.min_train_gpus
        trainer_sizes = {need, 2 * need, n // 4}
        rs = sorted({(n - t) // per * per for t in trainer_sizes if t >= need}, reverse=True)
        rs = [r for r in rs if r >= per and n - r >= need]
        return [{"rollout_gpus": r, "eta": e} for r in rs for e in etas]

    def split(self, cluster: Cluster) -> int:
        per, n, need = cluster.gpus_per_engine, cluster.n_gpus, cluster.min_train_gpus
        r = self.rollout_gpus if self.rollout_gpus is not None else (n - need) // per * per
        if r < per or n - r < need or r % per:
            raise ClusterError(
                f"async: rollout_gpus={r} must be a positive multiple of {per} leaving >= {need} of {n} GPUs to train"
            )
        return r

    def run(self, cluster: Cluster, steps: int):
        r = self.split(cluster)
        engines = yield all_of([cluster.start_engine(s) for s in engine_slots(range(r), cluster.gpus_per_engine)])
        trainer = list(range(r, cluster.n_gpus))
        batcher = Batcher(cluster, steps, self.eta)

        def produce():
            while batcher.n_admitted < steps * batcher.gps:
                version = min(e.version for e in engines)
                if not batcher.can_admit(version):
                    yield batcher.changed.wait()
                    continue
                g = batcher.admit_group(version)
                batcher.watch(g, spread(cluster, g.executions, engines))

        producer = cluster.spawn(produce(), "async-producer")
        while cluster.version < steps:
            batch = batcher.next_batch()
            if batch is None:
                yield batcher.changed.wait()
                continue
            batcher.trained(batch)
            yield cluster.train(trainer, batch)
            yield cluster.sync(engines)
            batcher.changed.fire()
        if not producer.done:
            yield any_of([producer])
