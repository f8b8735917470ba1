"""Run one policy on one simulated workload and collect the result."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.config import RunConfig
from gyre.faults import fault_summary
from gyre.gc_pause import no_gc
from gyre.hardware import Costs
from gyre.metrics import RunMetrics, compute_metrics
from gyre.policies import make_policy
from gyre.sim.cluster.bound import Bound, lower_bound
from gyre.sim.harness.sched_cuts import scheduler_cuts
from gyre.sim.cluster.backend import SimCluster
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
        n_gpus=cfg.cluster.gpus, costs=costs, source=src, check=check, faults=cfg.faults, seed=cfg.seed,
        checkpoint_every=cfg.checkpoint_every, cell_gpus=cfg.cluster.cell_gpus, standalone_gpus=cfg.cluster.standalone_gpus,
        sampling=cfg.sampling,
    )
    t0 = time.perf_counter()
    with no_gc():  # millions of log records and executions: see gyre.gc_pause
        cluster.run(pol, cfg.steps, progress=progress)
        wall = time.perf_counter() - t0
        issued = [g.spec for g in cluster.groups.values()]  # in issue order
        # the bound covers the groups the run had to train: the first steps x groups_per_step drawn
        must = issued[: cfg.steps * cfg.workload.groups_per_step]
        metrics = compute_metrics(cluster.log, n_gpus=cfg.cluster.gpus, policy=name)
        metrics.extra["kv_peak_frac"] = cluster.kv_peak_frac()
        metrics.roofline_gpu_s = cluster.roofline_gpu_s()
        metrics.extra["executions"] = sum(len(g.executions) for g in must)  # the run's executions (equal work)
        metrics.extra.update(scheduler_cuts(cluster.log, issued, costs))
        metrics.extra["trained_other_groups"] = int({g.group_id for g in must} != set(cluster.trained_groups))
        if cfg.faults:  # what the run survived, counted from its log (the real backend's columns)
            metrics.extra.update(fault_summary(cluster.log))
        bound = lower_bound(must, costs, cfg.cluster.gpus, cfg.workload.groups_per_step, getattr(pol, "eta", None),
                            sampling=cfg.sampling, workload=cfg.workload, seed=cfg.seed)
    return SimResult(name, cfg, costs, cluster.log, metrics, bound, wall, cluster.events, issued)
