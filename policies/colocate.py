"""Colocate: every GPU generates step k's rollouts with weights v_k; when the whole batch is done,
every GPU switches to training, trains, and switches back (engines restart with the new weights).
Strictly on-policy. The tail of each step leaves most GPUs waiting for the slowest execution.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster
from gyre.handles import all_of
from gyre.policies.common import ClusterShape, engine_slots, spread


@dataclass(frozen=True, kw_only=True)
class ColocateConfig:
    """Colocate has no parameters: every GPU does one thing at a time."""


class Colocate:
    name = "colocate"
    Config = ColocateConfig
    baseline = True  # results are reported as speedups over it
    eta = 0  # strictly on-policy

    def __init__(self, config: ColocateConfig | None = None) -> None:
        self.config = config or ColocateConfig()

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        return [{}]

    def run(self, cluster: Cluster, steps: int):
        all_gpus = list(range(cluster.n_gpus))
        slots = engine_slots(all_gpus, cluster.gpus_per_engine)
        for _ in range(steps):
            engines = yield all_of([cluster.start_engine(s) for s in slots])
            groups = [cluster.next_group() for _ in range(cluster.groups_per_step)]
            yield all_of(spread(cluster, [x for g in groups for x in g.executions], engines))
            yield all_of([cluster.stop_engine(e) for e in engines])
            yield cluster.train(cluster.free_gpus(), groups)
