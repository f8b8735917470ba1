"""Run one policy on one simulated workload and collect the result."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.config import RunConfig
from gyre.hardware import Costs
from gyre.metrics import RunMetrics, compute_metrics
from gyre.policies import make_policy
from gyre.policies.bound import Bound, lower_bound
from gyre.sim.backend import SimCluster
from gyre.workload import GroupSpec, WorkloadSource


@dataclass
class SimResult:
    policy: str
    config: RunConfig
    costs: Costs
    log: list[tuple]
    metrics: RunMetrics
    bound: Bound
    wall_s: float
    events: int
    groups: list[GroupSpec] = field(default_factory=list)  # every issued group, in issue order (traces)

    @property
    def makespan_s(self) -> float:
        return self.metrics.makespan_s


def simulate(
    cfg: RunConfig,
    policy: str | Any,
    params: dict[str, Any] | None = None,
    *,
    source=None,
    check: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> SimResult:
    """Simulate `policy` (a registered name, a dotted path, or a policy object) on `cfg`."""
    cfg.validate()
    costs = cfg.costs()
    if isinstance(policy, str):
        name = policy
        pol = make_policy(policy, **{**cfg.policy_params.get(policy, {}), **(params or {})})
    else:
        pol, name = policy, getattr(policy, "name", type(policy).__name__)
    src = source if source is not None else WorkloadSource(cfg.workload, cfg.seed)
    cluster = SimCluster(
        n_gpus=cfg.cluster.gpus, gpus_per_node=cfg.cluster.gpu.gpus_per_node, costs=costs, source=src, check=check
    )
    t0 = time.perf_counter()
    cluster.run(pol, cfg.steps, progress=progress)
    wall = time.perf_counter() - t0
    specs = [g_spec for g_spec in _group_specs(cluster)]
    metrics = compute_metrics(cluster.log, n_gpus=cfg.cluster.gpus, policy=name)
    bound = lower_bound(specs, costs, cfg.cluster.gpus, cfg.workload.groups_per_step, getattr(pol, "eta", None))
    issued = [
        GroupSpec(group_id=g.id, task_id=g.task_id, step=g.step, executions=[e.spec for e in g.executions])
        for g in cluster.groups.values()
    ]
    return SimResult(name, cfg, costs, cluster.log, metrics, bound, wall, cluster.events, issued)


def _group_specs(cluster: SimCluster):
    from gyre.workload import GroupSpec

    trained = {rec[3] for rec in cluster.log if rec[0] == "trained"}
    for gid in sorted(trained):
        g = cluster.groups[gid]
        yield GroupSpec(group_id=g.id, task_id=g.task_id, step=g.step, executions=[e.spec for e in g.executions])
