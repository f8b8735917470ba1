"""Compare policies on one workload and seed: every registered policy (or those named), each at its best.

A baseline is only fair at its best setting, so a policy the run config does not parameterize is run at
every parameter set of its own sweep grid (`grid` on the policy class, eta in {1, 2, 4}) and the fastest
is reported. Runs go to worker processes (one per core); the results are written by gyre.outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from gyre import outputs, plots
from gyre.config import RunConfig
from gyre.outputs import RunOutput
from gyre.policies import REGISTRY, ClusterShape, baselines, sweep
from gyre.sim.runner import SimResult, simulate


@dataclass(frozen=True)
class Candidate:
    policy: str
    params: dict[str, Any]

    @property
    def label(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.policy}({args})" if args else self.policy


def candidates(cfg: RunConfig, policies: list[str] | None = None, etas: tuple[int, ...] = (1, 2, 4)) -> list[Candidate]:
    """Every policy at its configured params; where none are configured, every set of its sweep grid."""
    costs = cfg.costs()
    shape = ClusterShape(n_gpus=cfg.cluster.gpus, gpus_per_engine=costs.engine_gpus,
                         min_train_gpus=costs.min_train_gpus)
    out = []
    for name in policies or list(REGISTRY):
        if name in cfg.policy_params:
            out.append(Candidate(name, dict(cfg.policy_params[name])))
        else:
            out += [Candidate(name, params) for params in sweep(name, shape, etas)]
    return out


def _run(args: tuple[RunConfig, Candidate, Any]) -> SimResult:
    cfg, cand, source_factory = args
    source = source_factory() if source_factory is not None else None
    return simulate(cfg, cand.policy, cand.params, source=source)


def run_candidates(
    cfg: RunConfig,
    cands: list[Candidate],
    *,
    source_factory: Callable[[], Any] | None = None,
    workers: int | None = None,
    on_done: Callable[[Candidate, SimResult], None] | None = None,
) -> list[SimResult]:
    workers = workers or min(len(cands), os.cpu_count() or 1)
    jobs = [(cfg, c, source_factory) for c in cands]
    if workers <= 1:
        results = []
        for job in jobs:
            results.append(_run(job))
            if on_done:
                on_done(job[1], results[-1])
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run, job) for job in jobs]
        results = []
        for c, f in zip(cands, futures):
            results.append(f.result())
            if on_done:
                on_done(c, results[-1])
    return results


def best_per_policy(cands: list[Candidate], results: list[SimResult]) -> dict[str, tuple[Candidate, SimResult]]:
    best: dict[str, tuple[Candidate, SimResult]] = {}
    for c, r in zip(cands, results):
        if c.policy not in best or r.makespan_s < best[c.policy][1].makespan_s:
            best[c.policy] = (c, r)
    return best


def comparison_table(best: dict[str, tuple[Candidate, SimResult]]) -> pd.DataFrame:
    rows = []
    bound = min(max(r.bound.work_s, r.bound.critical_path_s) for _, r in best.values())
    for name, (c, r) in best.items():
        s = r.metrics.summary()
        s["config"] = c.label
        s["bound_s"] = bound
        s["vs_bound"] = r.makespan_s / bound
        s["eta_bound_s"] = r.bound.makespan_s  # the bound under this policy's own staleness bound
        s["vs_eta_bound"] = r.makespan_s / r.bound.makespan_s
        s["sim_wall_s"] = r.wall_s
        s["events"] = r.events
        rows.append(s)
    df = pd.DataFrame(rows)
    for base in baselines():
        if base in best:
            df[f"speedup_vs_{base}"] = best[base][1].makespan_s / df["makespan_s"]
    return df


def write_outputs(out: Path, cfg: RunConfig, best: dict[str, tuple[Candidate, SimResult]], table: pd.DataFrame,
                  sweep: pd.DataFrame | None = None) -> dict[str, Path]:
    """gyre.outputs' files for the best run of each policy, plus sweep.csv (every run) and gpu_hours.png."""
    runs = [RunOutput(name=name, label=f"{name}: {c.label}", log=r.log, metrics=r.metrics)
            for name, (c, r) in best.items()]
    paths = outputs.write_outputs(out, runs, table, preset=cfg.name, seed=cfg.seed, n_gpus=cfg.cluster.gpus)
    if sweep is not None:
        sweep.to_csv(out / "sweep.csv", index=False)
    paths["gpu_hours"] = plots.step_breakdown(table.to_dict(orient="records"), out / "gpu_hours.png")
    return paths
