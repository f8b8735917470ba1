"""Async: a fixed split. R GPUs always generate, the other N - R always train. Generation never stops;
the trainer takes a batch when one is ready (policies.common.Batcher enforces staleness <= eta by
admission control), then engines receive the new weights in place.
Executions wait unstarted in one policies.admit_queue.AdmissionQueue until an engine has room.

R defaults to every GPU the trainer does not need. A fair comparison needs async at its best split and
staleness bound: its grid (`grid`) is every engine multiple R that leaves the trainer its memory minimum,
times each eta given, and its search (`search`, policies.tuning.refine_axis) finds that grid's best with
a coarse pass over R at every eta and bisection towards the best R.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster, ClusterError
from gyre.handles import all_of
from gyre.policies.admission import ForesightParams, OrderedAdmission
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Batcher, ClusterShape, engine_slots, train_loop
from gyre.policies.tuning import Search, refine_axis


@dataclass(frozen=True, kw_only=True)
class AsyncConfig(ForesightParams):
    rollout_gpus: int | None = None  # R; None: every GPU the trainer does not need
    eta: int = 1  # staleness bound

    def __post_init__(self) -> None:
        super().__post_init__()
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
        return [{"rollout_gpus": r, "eta": e} for r in AsyncSplit.splits(shape) for e in etas]

    @staticmethod
    def splits(shape: ClusterShape) -> list[int]:
        """Every R, a multiple of the engine size, that leaves the trainer >= its memory minimum."""
        per = shape.gpus_per_engine
        return list(range(per, shape.n_gpus - shape.min_train_gpus + 1, per))

    @staticmethod
    def search(shape: ClusterShape, etas: tuple[int, ...]) -> Search:
        return refine_axis("rollout_gpus", AsyncSplit.splits(shape), etas)

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
        order = OrderedAdmission(cluster, steps, self.config)
        batcher = Batcher(cluster, steps, self.eta, order)
        queue = AdmissionQueue(cluster, engines)

        def gather(_batch):
            return trainer
            yield  # a generator: the trainer's GPUs are always its own

        def after_step():
            yield cluster.sync(engines)

        yield from train_loop(cluster, steps, batcher, queue, engines=lambda: engines, gather=gather,
                              after_step=after_step, label="async-producer")
        order.report()
