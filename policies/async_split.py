"""Async: a fixed split. R GPUs always generate, the other N - R always train. Generation never stops;
the trainer takes a batch when one is ready (policies.common.Batcher enforces staleness <= eta by
admission control), then engines receive the new weights in place.
Executions wait unstarted in one policies.admit_queue.AdmissionQueue until an engine has room.

R defaults to every GPU the trainer does not need. With `streaming`, each batch trains in a streaming step on
the trainer's cells (gyre.cluster.StepView), opened as soon as the batch is chosen: its groups train as they
finish instead of after the last one (the paper's "Async + streaming"). `max_running` caps the executions each engine holds
at once below the engine's own admission limit (gyre.hardware.admission_limit; None: that limit).

A fair comparison needs async at its best split, staleness bound and per-engine concurrency: its grid
(`grid`) is every engine multiple R that leaves the trainer its memory minimum, times each eta given,
times each cap in `caps` (the halvings of the engine's admission limit), and its search (`search`,
policies.tuning.refine_split_and_cap) finds that grid's best at equal work with a coarse pass and
bisection over R at the full limit, every cap at each eta's best R, and R refined at the cap chosen.

Why a cap among the searched settings: a decode step's time grows with the batch (more distinct experts
read, more KV), so an engine carrying its whole admission limit runs a long rollout several times slower
than alone, and past its deadline; fewer per engine trades throughput for the tail, a choice of the same
kind as R that no rule derived from KV alone settles (experiments/equal_work/README.md, "Where ... cuts
come from"). Why a policy cap and not the cluster's `admission_fill`: the fill is a property of the
serving engine shared by every policy in a comparison, while the cap is this policy's own admission
choice, searched per configuration like R and shown in its label. Why halvings of the admission limit:
the values follow from the engine (its KV and the workload's window), not from a target ratio or a
preset, and halving the cap about halves the decode batch, the quantity the step time follows;
log2(limit) + 1 values keep the search small.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster, ClusterError
from gyre.handles import all_of
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import Batcher, ClusterShape, engine_slots, train_loop
from gyre.policies.tuning import Search, halvings, refine_axis, refine_split_and_cap


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    rollout_gpus: int | None = None  # R; None: every GPU the trainer does not need
    eta: int = 1  # staleness bound
    max_running: int | None = None  # executions an engine holds at once, at most; None: its admission limit
    streaming: bool = False  # train each batch in a streaming step on the trainer's cells (groups as they finish)

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"async: eta must be >= 0, got {self.eta}")
        if self.max_running is not None and (isinstance(self.max_running, bool) or not isinstance(self.max_running, int)
                                             or self.max_running < 1):
            raise ValueError(f"async: max_running must be an integer >= 1, got {self.max_running!r}")


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
        return [{"rollout_gpus": r, "eta": e, **c} for r in AsyncSplit.splits(shape) for e in etas
                for c in ([{"max_running": k} for k in AsyncSplit.caps(shape)] or [{}])]

    @staticmethod
    def caps(shape: ClusterShape) -> list[int]:
        """The per-engine caps searched: the engine's admission limit and its halvings down to 1 (none
        when the shape does not know the limit)."""
        return halvings(shape.admit_limit) if shape.admit_limit else []

    @staticmethod
    def splits(shape: ClusterShape) -> list[int]:
        """Every R, a multiple of the engine size, that leaves the trainer >= its memory minimum."""
        per = shape.gpus_per_engine
        return list(range(per, shape.n_gpus - shape.min_train_gpus + 1, per))

    @staticmethod
    def search(shape: ClusterShape, etas: tuple[int, ...]) -> Search:
        caps = AsyncSplit.caps(shape)
        if not caps:
            return refine_axis("rollout_gpus", AsyncSplit.splits(shape), etas)
        return refine_split_and_cap("rollout_gpus", AsyncSplit.splits(shape), "max_running", caps, etas)

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
        cap = self.config.max_running
        queue = AdmissionQueue(cluster, engines, limit=None if cap is None else (lambda e: cap))

        def gather(_batch):
            return trainer
            yield  # a generator: the trainer's GPUs are always its own

        def after_step():
            yield cluster.sync(engines)

        yield from train_loop(cluster, steps, batcher, queue, engines=lambda: engines, gather=gather,
                              after_step=after_step, label="async-producer", streaming=self.config.streaming)
