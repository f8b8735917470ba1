"""Run one policy on the real backend and write what the simulator writes, plus a rollout trace.

A real run is a `RealRunConfig` (presets are plain functions; a TOML file overrides fields of one,
see docs/real.md) -> `run_real` -> `RealResult` -> `write_outputs`, which writes the simulator's files
(summary.csv/json, steps_<policy>.csv, staleness_<policy>.csv, utilization_<policy>.parquet,
role_timeline.png, utilization.png) and, for replay and calibration, `trace.jsonl` (gyre.traces.schema),
`profile.json` (measured engine step, prefill, train, sync and role-switch times) and
`learning_<policy>.csv` (reward vs step and wall time) and `log_<policy>.jsonl` (the raw event log). summary.csv
also says what the run survived (gyre.real.faults.fault_summary, counted from the log).

Simplifications: one policy per run; the actor pool is created on first use and may be passed in to
reuse warm actors across runs (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from gyre import plots
from gyre.metrics import RunMetrics, compute_metrics
from gyre.nn.hf_llama import check_hf_llama, config_mismatch
from gyre.nn.model import ModelConfig
from gyre.real import task as T
from gyre.real.backend import RealCluster, RealClusterConfig
from gyre.real.engine_torch import TorchEngineConfig
from gyre.real.faults import fault_summary
from gyre.real.pool import ActorPool, PoolConfig
from gyre.real.trainer import TrainerConfig


class RealConfigError(ValueError):
    """A bad real-run configuration; the message names the file and field."""


@dataclass(kw_only=True, frozen=True)
class RealRunConfig:
    name: str
    pool: PoolConfig
    cluster: RealClusterConfig
    steps: int = 30
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)


def preset_tiny_cpu() -> RealRunConfig:
    """4 logical GPUs on local Ray, 1 GPU per engine, a 2-layer d=64 model: minutes on a laptop CPU."""
    return RealRunConfig(
        name="tiny-cpu",
        pool=PoolConfig(n_gpus=4, gpus_per_engine=1, model=ModelConfig(vocab_size=T.VOCAB_SIZE),
                        engine_config=TorchEngineConfig(), trainer_config=TrainerConfig(lr=3e-3, epochs=4)),
        cluster=RealClusterConfig(groups_per_step=4, group_size=8),
        steps=30,
    )


def preset_tiny_test() -> RealRunConfig:
    """tiny-cpu with 2 small groups per step and 2 steps (the test tier)."""
    base = preset_tiny_cpu()
    return dataclasses.replace(base, name="tiny-test", steps=2, policy_params={},
                               cluster=dataclasses.replace(base.cluster, groups_per_step=2, group_size=4))


PRESETS = {"tiny-cpu": preset_tiny_cpu, "tiny-test": preset_tiny_test}


def get_preset(name: str) -> RealRunConfig:
    if name not in PRESETS:
        raise RealConfigError(f"unknown real preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def _replace(obj, table: dict, where: str, prefix: str = ""):
    """dataclasses.replace with nested tables; unknown fields are one-line errors naming them."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    kw = {}
    for k, v in table.items():
        if k not in fields:
            raise RealConfigError(f"{where}: unknown field {prefix + k!r} (known: {', '.join(sorted(fields))})")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur) and isinstance(v, dict):
            v = _replace(cur, v, where, f"{prefix}{k}.")
        elif isinstance(cur, tuple) and isinstance(v, list):
            v = tuple(v)
        elif isinstance(cur, tuple) and isinstance(v, dict):
            v = tuple(sorted(v.items()))
        kw[k] = v
    try:
        return dataclasses.replace(obj, **kw)
    except (TypeError, ValueError) as exc:
        raise RealConfigError(f"{where}: {prefix or 'run'}: {exc}") from None


def load_config(path: str | Path) -> RealRunConfig:
    """A TOML file: `preset = "tiny-cpu"` plus tables overriding its fields ([pool], [cluster.task], ...).

    With `[pool] init_checkpoint = "dir"` (a Llama model directory) the model config is read from dir/config.json."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RealConfigError(f"{p}: {exc}") from None
    base = get_preset(data.pop("preset", "tiny-cpu"))
    init = (data.get("pool") or {}).get("init_checkpoint")
    if not init:
        return _replace(base, data, str(p))
    try:  # the model is the checkpoint's; a [pool.model] table may only restate it
        ckpt = check_hf_llama(init)
    except ValueError as exc:
        raise RealConfigError(f"{p}: pool.init_checkpoint: {exc}") from None
    cfg = _replace(dataclasses.replace(base, pool=dataclasses.replace(base.pool, model=ckpt)), data, str(p))
    bad = config_mismatch(cfg.pool.model, ckpt)
    if bad:
        raise RealConfigError(f"{p}: pool.model.{bad} (pool.init_checkpoint = {init!r}); omit [pool.model] to "
                              f"take the checkpoint's")
    return cfg


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
             steps: int | None = None) -> RealResult:
    """Run `policy` (a registered name, dotted path or object) for `steps` (default cfg.steps)."""
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
    cluster = RealCluster(pool=pool, config=cfg.cluster)
    t0 = time.perf_counter()
    try:
        cluster.run(pol, steps or cfg.steps, on_tick=on_tick)
    finally:
        profile = cluster.close()
    wall = time.perf_counter() - t0
    metrics = compute_metrics(cluster.log, n_gpus=cfg.pool.n_gpus, policy=name)
    return RealResult(name, cfg, cluster.log, metrics, profile, wall, cluster)


def trace_groups(cluster: RealCluster):
    """The run's groups as gyre.workload GroupSpecs (measured shapes) plus per-execution outcomes."""
    from gyre.traces.schema import Outcome
    from gyre.workload import ExecutionSpec, GroupSpec

    groups, outcomes = [], {}
    for g in cluster.groups.values():
        specs = []
        for x in g.executions:
            if not x.segs or any(s["gen"] < 1 for s in x.segs):
                continue  # never ran (an unfinished run)
            n = len(x.segs)
            gen = [s["gen"] for s in x.segs]
            kv = [s["kv"] for s in x.segs]
            specs.append(ExecutionSpec(
                exec_id=x.id, group_id=g.id, task_id=g.task_id, step=g.id // cluster.cfg.groups_per_step,
                prompt=len(g.spec.prompt), gen=gen, kv=kv,
                tool_s=[float(s.get("tool_s", 0.0)) for s in x.segs[:-1]],
                tool_out=[max(0, kv[i + 1] - kv[i] - gen[i]) for i in range(n - 1)],
                branches=[(i, k) for i, k in x.branch_marks if i < n], capped=x.turns >= cluster.cfg.task.max_turns,
                deadline_s=cluster.cfg.task.deadline_s,
            ))
            outcomes[x.id] = Outcome(version=x.first_version, deadline_hit=bool(x.truncated), reward=x.reward,
                                     start_s=x.started_at, end_s=x.finished_at)
        if specs:
            groups.append(GroupSpec(group_id=g.id, task_id=g.task_id, step=g.id // cluster.cfg.groups_per_step,
                                    executions=specs))
    return groups, outcomes


def trace_workload(cfg: RealRunConfig):
    """A WorkloadConfig describing the built-in task (the trace header; replay reads the records)."""
    from gyre.workload import LogNormal, WorkloadConfig

    t = cfg.cluster.task
    return WorkloadConfig(
        name="real-agent-task", groups_per_step=cfg.cluster.groups_per_step, group_size=cfg.cluster.group_size,
        prompt_tokens=LogNormal(median=3, p99_ratio=1.0), turns=LogNormal(median=3, p99_ratio=2.0),
        max_turns=t.max_turns, gen_tokens=LogNormal(median=t.max_new_tokens, p99_ratio=1.0),
        tool_out_tokens=LogNormal(median=3, p99_ratio=1.0), tool_s=LogNormal(median=t.fast_tool_s, p99_ratio=3.2),
        slow_tool_p=t.slow_tool_p, slow_tool_s=LogNormal(median=sum(t.slow_tool_s) / 2, p99_ratio=1.5),
        context_window=t.context_limit, summary_tokens=6, deadline_s=t.deadline_s,
    )


def write_outputs(out: str | Path, results: list[RealResult]) -> dict[str, Path]:
    """The simulator's output files for these runs, plus trace_<policy>.jsonl and profile_<policy>.json."""
    from gyre.traces.schema import write_trace

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame([{**r.metrics.summary(), "wall_s": r.wall_s, **fault_summary(r.log)} for r in results])
    paths = {"summary": out / "summary.csv"}
    table.to_csv(paths["summary"], index=False)
    cfg = results[0].config
    (out / "summary.json").write_text(json.dumps({"preset": cfg.name, "seed": cfg.cluster.seed,
                                                  "results": table.to_dict(orient="records")}, indent=2, default=float))
    for r in results:
        m, name = r.metrics, r.policy
        m.steps.assign(policy=name).to_csv(out / f"steps_{name}.csv", index=False)
        m.utilization.assign(policy=name).to_parquet(out / f"utilization_{name}.parquet", index=False)
        m.staleness.assign(policy=name).to_csv(out / f"staleness_{name}.csv", index=False)
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
    n = cfg.pool.n_gpus
    paths["timeline"] = plots.role_timelines([(f"{r.policy} (real)", r.log, n, r.makespan_s) for r in results],
                                             out / "role_timeline.png")
    paths["utilization"] = plots.utilization([(r.policy, r.metrics.utilization) for r in results], n,
                                             out / "utilization.png")
    return paths
