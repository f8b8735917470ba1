"""Run one policy on the real backend and write what the simulator writes, plus a rollout trace.

A real run is a `RealRunConfig` (gyre.real.config; a TOML file overrides fields of a preset, see
gyre.real.config_file and docs/real.md) -> `run_real` -> `RealResult` -> `write_outputs`, which writes
gyre.outputs' files (summary.csv/json, steps_<policy>.csv, staleness_<policy>.csv,
utilization_<policy>.parquet, role_timeline.png, utilization.png) and, for replay and calibration,
`trace_<policy>.jsonl` (gyre.real.trace_export), `profile_<policy>.json` (measured engine step, prefill,
train, sync and role-switch times), `executions_<policy>.csv`, `learning_<policy>.csv` (reward vs step and
wall time) and `log_<policy>.jsonl` (the raw event log). summary.csv also says what the run survived
(gyre.faults.fault_summary, counted from the log) and the deadline cuts the scheduler may have caused
(gyre.real.work, an upper bound). While it runs, `run_real(out=...)` streams metrics and keeps
logs there (gyre.real.watch) and at its end exports the trained model (gyre.real.export); a checkpointed run
resumes its trainer, its task sequence and its policy's state (gyre.real.run_state).

Simplifications: one policy per run; the actor pool is created on first use and may be passed in to
reuse warm actors across runs (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from gyre import outputs
from gyre.metrics import RunMetrics, compute_metrics
from gyre.outputs import RunOutput
from gyre.real.backend import RealCluster
from gyre.real.config import RealConfigError, RealRunConfig
from gyre.faults import fault_summary
from gyre.real.verify import outcome_counts
from gyre.real.pool import ActorPool
from gyre.real.export import export_run
from gyre.real.trace_export import trace_groups, trace_workload
from gyre.real.run_state import RunState, restore_policy, read_run_state, config_from_run_state, saved_policy_state
from gyre.real.watch import RunWatch, write_partial
from gyre.real.work import scheduler_cuts


@dataclass
class RealResult:
    policy: str
    config: RealRunConfig
    log: list[tuple]
    metrics: RunMetrics
    profile: dict
    wall_s: float
    cluster: RealCluster

    @property
    def makespan_s(self) -> float:
        return self.metrics.makespan_s

    def learning(self) -> pd.DataFrame:
        """Per step: version, end time, mean reward of its batch, loss, logp_mismatch (mean |log-ratio| of
        the weights before the step to the engines that sampled its tokens: ~0 when on-policy), and
        groups_with_signal (groups whose rewards differ, so their advantages are not all 0)."""
        cols = ["version", "t_s", "reward_mean", "loss", "logp_mismatch", "groups_with_signal", "epochs", "drift"]
        rows = [{"version": r[3]["version"], "t_s": r[1], "reward_mean": r[3]["reward_mean"], "loss": r[3]["loss"],
                 "logp_mismatch": r[3].get("logp_mismatch", float("nan")),
                 "groups_with_signal": r[3].get("groups_with_signal", -1), "epochs": r[3].get("epochs", -1),
                 "drift": r[3].get("drift", float("nan"))}
                for r in self.log if r[0] == "note" and r[2] == "train"]
        return pd.DataFrame(rows, columns=cols)

    def stalled_since(self, steps: int = 3) -> int | None:
        """The first version of the final run of >= `steps` steps in which no group had a reward spread (every
        advantage 0, so no gradient: the policy collapsed), or None."""
        sig = self.learning()["groups_with_signal"].to_numpy()
        k = len(sig)
        while k > 0 and sig[k - 1] == 0:
            k -= 1
        return k + 1 if len(sig) - k >= steps else None


def run_real(cfg: RealRunConfig, policy: str | Any, *, pool: ActorPool | None = None, on_tick=None,
             steps: int | None = None, out: str | Path | None = None, print_fn=None) -> RealResult:
    """Run `policy` (a registered name, dotted path or object) for `steps` (default cfg.steps).

    With a `checkpoint` whose run state exists (`<checkpoint>.run.json`), the run resumes (gyre.real.run_state): the
    trainer from the checkpoint, the task sequence (drawn but untrained tasks first) and the policy's state. With `out`, the run
    is watched (gyre.real.watch: metrics per step, TensorBoard, progress through `print_fn`, Ray logs), a failed
    run leaves its log and error there, and a finished one its trained model as a Hugging Face folder (model/)."""
    from gyre.policies import make_policy

    if isinstance(policy, str):
        name, pol = policy, make_policy(policy, **cfg.policy_params.get(policy, {}))
    else:
        name, pol = getattr(policy, "name", type(policy).__name__), policy
    pool = pool or ActorPool.shared(cfg.pool)
    if pool.cfg != cfg.pool:  # its actors were built for another config: this run's settings would be ignored
        differ = [f.name for f in dataclasses.fields(cfg.pool) if getattr(pool.cfg, f.name) != getattr(cfg.pool, f.name)]
        raise RealConfigError(f"run_real: the pool was built for a different [pool] config ({', '.join(differ)} "
                              f"differ); pass pool=ActorPool.shared(cfg.pool)")
    ckpt = cfg.cluster.checkpoint
    state = read_run_state(ckpt)
    cfg = dataclasses.replace(cfg, cluster=config_from_run_state(cfg.cluster, state))
    saved = saved_policy_state(ckpt) if state is not None else None
    cluster = RealCluster(pool=pool, config=cfg.cluster)
    n = steps or cfg.steps
    watch = RunWatch(out, name, n, print_fn=print_fn, resume=state is not None) if out is not None else None
    own = [t for t in (ckpt and RunState(ckpt, pol, name).tick, watch and watch.tick) if t]
    ticks = own + ([on_tick] if on_tick else [])
    t0 = time.perf_counter()
    try:
        cluster.run(pol, n, on_tick=lambda c: [t(c) for t in ticks],
                    on_start=(lambda c: restore_policy(pol, name, saved, c)) if state is not None else None)
        for t in own:
            t(cluster)  # the last step's records
    except BaseException as exc:
        if out is not None:
            write_partial(out, name, cluster.log, exc)
        raise
    finally:
        profile = cluster.close()
        if watch is not None:
            watch.finish()
    wall = time.perf_counter() - t0
    if out is not None:
        export_run(cluster, Path(out) / "model" / name)
    metrics = compute_metrics(cluster.log, n_gpus=cfg.pool.n_gpus, policy=name)
    metrics.extra.update(scheduler_cuts((x for g in cluster.groups.values() for x in g.executions), profile))
    metrics.extra["steps_per_burst"] = cfg.cluster.steps_per_burst  # mu: engines served every mu-th version
    return RealResult(name, cfg, cluster.log, metrics, profile, wall, cluster)


def write_outputs(out: str | Path, results: list[RealResult]) -> dict[str, Path]:
    """gyre.outputs' files for these runs, plus each run's trace, profile, executions, learning curve and log."""
    from gyre.traces.schema import write_trace

    out = Path(out)
    table = pd.DataFrame([{**r.metrics.summary(), "wall_s": r.wall_s, **fault_summary(r.log), **outcome_counts(r.log)}
                          for r in results])
    cfg = results[0].config
    runs = [RunOutput(name=r.policy, label=f"{r.policy} (real)", log=r.log, metrics=r.metrics) for r in results]
    paths = outputs.write_outputs(out, runs, table, preset=cfg.name, seed=cfg.cluster.seed, n_gpus=cfg.pool.n_gpus)
    for r in results:
        m, name = r.metrics, r.policy
        m.executions.assign(policy=name).to_csv(out / f"executions_{name}.csv", index=False)
        r.learning().assign(policy=name).to_csv(out / f"learning_{name}.csv", index=False)
        groups, outcomes = trace_groups(r.cluster)
        paths[f"trace_{name}"] = out / f"trace_{name}.jsonl"
        write_trace(paths[f"trace_{name}"], groups, workload=trace_workload(r.config), outcomes=outcomes,
                    run={"backend": "real", "preset": r.config.name, "policy": name, "seed": r.config.cluster.seed,
                         "steps": len(m.steps), "makespan_s": m.makespan_s, "n_gpus": m.n_gpus,
                         "gpus_per_engine": r.config.pool.gpus_per_engine, "kv_capacity": r.config.cluster.kv_capacity,
                         "min_train_gpus": r.config.cluster.min_train_gpus, "params": r.config.policy_params})
        (out / f"profile_{name}.json").write_text(json.dumps(r.profile, default=float))
        with open(out / f"log_{name}.jsonl", "w") as f:  # the raw event log (gyre.metrics schema)
            for rec in r.log:
                f.write(json.dumps(list(rec), default=float) + "\n")
    return paths
