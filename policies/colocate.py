"""Colocate: every GPU generates step k's rollouts with weights v_k; when the whole batch is done,
every GPU switches to training, trains, and switches back (engines restart with the new weights).
Strictly on-policy. The tail of each step leaves most GPUs waiting for the slowest execution.
"""

from __future__ import annotations

from gyre.cluster import Cluster
from gyre.handles import all_of
from gyre.policies.common import engine_slots, spread


class Colocate:
    name = "colocate"
    eta = 0  # strictly on-policy

    def run(self, cluster: Cluster, steps: int):
        all_gpus = list(range(cluster.n_gpus))
        slots = engine_slots(all_gpus, cluster.gpus_per_engine)
        for _ in range(steps):
            engines = yield all_of([cluster.start_engine(s) for s in slots])
            groups = [cluster.next_group() for _ in range(cluster.groups_per_step)]
            yield all_of(spread(cluster, [x for g in groups for x in g.executions], engines))
            yield all_of([cluster.stop_engine(e) for e in engines])
            yield cluster.train(cluster.free_gpus(), groups)
