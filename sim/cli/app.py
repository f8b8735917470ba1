"""`gyre-sim`: run, compare and inspect scheduling policies in the simulator.

Every flag overrides one field of a named preset; user errors exit with code 2 and one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from gyre.config import ConfigError, RunConfig, override
from gyre.faults import spec_error
from gyre.policies import REGISTRY, UnknownPolicy, check_params, policy_class, takes
from gyre.presets import DEFAULT_PRESET, MODELS, PRESETS, get_preset
from gyre.sim.cli import calibrate_engine, traces
from gyre.sim.cli.console import console, fail, print_table, progress_bar, report_infeasible
from gyre.sim.harness.sweep import RAY_HELP

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Gyre simulator: compare RL scheduling policies.")


def parse_sets(sets: list[str] | None) -> dict:
    """`--set KEY=VALUE` pairs: a dotted field of the run's config (`cluster.cell_gpus=352`,
    `workload.steps_per_burst=3`) or a policy's parameter (`async.streaming=true`, `colocate.streaming=true`);
    a value reads as JSON (numbers, true / false) or else as text."""
    import json

    out: dict = {}
    for item in sets or []:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE (e.g. cluster.cell_gpus=352)")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


def build_config(preset: str, gpus: int | None, steps: int | None, seed: int | None, eta: int | None = None,
                 policies: list[str] | None = None, faults: list[str] | None = None,
                 checkpoint_every: int | None = None, sets: list[str] | None = None, j_max: str | None = None,
                 role_priority: str | None = None) -> RunConfig:
    """The preset with the flags applied; `eta` goes to the named policies (default: every one that has it);
    `sets` (--set) override dotted fields or, as `POLICY.PARAM=VALUE`, a policy's parameters; `j_max` (an integer
    or "uncapped") or `role_priority` (comma-separated roles) turn role-bounded sampling on."""
    bad = spec_error(faults or [])
    if bad:
        fail(bad)
    try:
        for p in policies or []:
            policy_class(p)
        cfg = override(get_preset(preset), **{"cluster.gpus": gpus, "steps": steps, "seed": seed,
                                              "faults": tuple(faults) if faults else None,
                                              "checkpoint_every": checkpoint_every})
        fields, params = {}, {}
        for key, value in parse_sets(sets).items():
            head, _, rest = key.partition(".")
            if rest and head not in ("cluster", "workload") and "." not in rest:
                policy_class(head)
                params.setdefault(head, {})[rest] = value
            else:
                fields[key] = value
        cfg = override(cfg, **fields)
        if params:
            merged = {p: {**cfg.policy_params.get(p, {}), **kv} for p, kv in params.items()}
            cfg = override(cfg, policy_params={**cfg.policy_params, **merged})
        if j_max is not None or role_priority is not None:
            j = j_max if j_max in (None, "uncapped") or not j_max.lstrip("-").isdigit() else int(j_max)
            prio = tuple(role_priority.split(",")) if role_priority else None
            cfg = override(cfg, **{"sampling.mode": "roles", "sampling.j_max": j, "sampling.role_priority": prio})
        if eta is not None:
            targets = policies or [p for p in REGISTRY if takes(p, "eta")]
            params = {p: {**cfg.policy_params.get(p, {}), "eta": eta} for p in targets}
            cfg = override(cfg, policy_params={**cfg.policy_params, **params})
        check_params(cfg.policy_params)
        return cfg.validate()
    except (ConfigError, UnknownPolicy) as exc:
        fail(str(exc))
        raise


Preset = Annotated[str, typer.Option("--preset", "-p", help="named preset (gyre-sim presets)")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the cluster")]
Steps = Annotated[Optional[int], typer.Option("--steps", help="training steps")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="workload seed")]
Out = Annotated[Path, typer.Option("--out", "-o", help="results folder")]
Faults = traces.FaultsOpt
CheckpointEvery = traces.CheckpointEveryOpt
Sets = Annotated[Optional[list[str]], typer.Option("--set", help="KEY=VALUE: a dotted config field (cluster.cell_gpus=352, "
                                                   "workload.steps_per_burst=3) or POLICY.PARAM (async.streaming=true); "
                                                   "repeatable")]
JMax = Annotated[Optional[str], typer.Option("--j-max", help="role-bounded path sampling: at most this many paths "
                                             "trained per execution (an integer >= 1, or 'uncapped')")]
RolePriority = Annotated[Optional[str], typer.Option("--role-priority", help="role-bounded path sampling: role "
                                                     "classes, highest first, e.g. main,main-summary,sub-agent,"
                                                     "sub-agent-summary")]


@app.command()
def run(
    policy: Annotated[str, typer.Option("--policy", help="registered name or dotted path")] = "colocate",
    preset: Preset = DEFAULT_PRESET,
    gpus: Gpus = None,
    steps: Steps = None,
    seed: Seed = None,
    eta: Annotated[Optional[int], typer.Option("--eta", help="staleness bound (every policy that has one)")] = None,
    out: Out = Path("out/run"),
    workload: Annotated[Optional[Path], typer.Option("--workload", help="calibrated workload JSON (gyre-sim calibrate)")] = None,
    trace_out: Annotated[Optional[Path], typer.Option("--trace-out", help="also write the run as a rollout trace (JSONL)")] = None,
    engine: calibrate_engine.EngineOpt = None,
    faults: Faults = None,
    checkpoint_every: CheckpointEvery = None,
    sets: Sets = None,
    j_max: JMax = None,
    role_priority: RolePriority = None,
) -> None:
    """Simulate one policy and write its metrics."""
    from gyre.sim.harness.compare import Candidate, comparison_table, write_outputs
    from gyre.sim.harness.runner import simulate

    cfg = calibrate_engine.with_engine(build_config(preset, gpus, steps, seed, eta, [policy], faults, checkpoint_every,
                                                    sets, j_max, role_priority),
                                       engine)
    with progress_bar() as prog:
        task = prog.add_task(f"{policy} on {cfg.name}", total=cfg.steps)
        try:
            source = None
            if workload is not None:
                cfg, source = traces.calibrated_source(cfg, workload)
            r = simulate(cfg, policy, source=source, progress=lambda v, t: prog.update(task, completed=v))
        except (UnknownPolicy, ValueError, OSError) as exc:
            fail(str(exc))
            raise
    if trace_out is not None:
        n = traces.write_run_trace(r, trace_out, preset)
        console.print(f"wrote {trace_out} ({n} executions)")
    best = {r.policy: (Candidate(r.policy, cfg.policy_params.get(policy, {})), r)}
    table = comparison_table(best)
    write_outputs(out, cfg, best, table)
    from gyre.sim.harness.compare import run_title

    print_table(table, f"{policy} on {run_title(cfg)}: {cfg.steps} steps, workload {cfg.workload.name}")
    console.print(f"wrote {out}/")


@app.command()
def compare(
    preset: Preset = DEFAULT_PRESET,
    gpus: Gpus = None,
    steps: Steps = None,
    seed: Seed = None,
    policy: Annotated[Optional[list[str]], typer.Option("--policy", help="restrict to these policies")] = None,
    out: Out = Path("out/compare"),
    engine: calibrate_engine.EngineOpt = None,
    faults: Faults = None,
    checkpoint_every: CheckpointEvery = None,
    j_max: JMax = None,
    role_priority: RolePriority = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help=RAY_HELP)] = None,
    sets: Sets = None,
    rows: traces.RowsOpt = "all",
) -> None:
    """Run every registered policy on the same workload and seed, each tuned (async also on a pilot)."""
    from gyre.sim.harness.compare import requested_rows, run_title, tune, tuned_table, write_outputs

    traces._rows_ok(rows)

    cfg = calibrate_engine.with_engine(build_config(preset, gpus, steps, seed, policies=policy, faults=faults,
                                                    checkpoint_every=checkpoint_every, sets=sets, j_max=j_max,
                                                    role_priority=role_priority), engine)
    report_infeasible(cfg, policy)
    with progress_bar() as prog:
        task = prog.add_task(f"tuning on {cfg.name}" + (f" (Ray: {ray})" if ray else ""), total=None)
        try:
            tuned = tune(cfg, policy, on_done=lambda c, r: prog.advance(task), ray=ray)
        except ConnectionError as exc:  # no Ray cluster at that address
            fail(f"--ray {ray}: {exc}")
            raise
    best, table, sweep = tuned_table(tuned)
    if rows == "requested":
        table = requested_rows(table, policy)
        best = {k: best[k] for k in table["policy"]}
    paths = write_outputs(out, cfg, best, table, sweep)
    print_table(table, f"{run_title(cfg)}: {cfg.steps} steps, seed {cfg.seed}, workload {cfg.workload.name}")
    console.print(f"wrote {paths['summary']}, {paths['timeline'].name}, {paths['utilization'].name}, "
                  f"{paths['gpu_hours'].name} in {out}/")


@app.command()
def presets() -> None:
    """List the named presets, and the models with their KV bytes per token and state bytes per sequence."""
    t = Table(title="presets")
    for c in ("name", "model", "GPUs", "engine GPUs", "steps", "groups x size", "description"):
        t.add_column(c)
    for name, fn in PRESETS.items():
        cfg = fn()
        costs = cfg.costs()
        t.add_row(name, cfg.cluster.model.name, str(cfg.cluster.gpus), str(costs.engine_gpus), str(cfg.steps),
                  f"{cfg.workload.groups_per_step} x {cfg.workload.group_size}", (fn.__doc__ or "").strip())
    console.print(t)
    m = Table(title="models")
    for c in ("name", "params (total / active)", "layers (full / linear)", "KV bytes per token",
              "state bytes per sequence"):
        m.add_column(c)
    for model in MODELS.values():
        m.add_row(model.name, f"{model.total_params_b:g}B / {model.active_params_b:g}B",
                  f"{model.layers} ({model.full_layers} / {model.linear_layers})", f"{model.kv_bytes_per_token:,.0f}",
                  f"{model.state_bytes_per_seq:,.0f}")
    console.print(m)


traces.register(app)
calibrate_engine.register(app)


def main() -> None:
    """The `gyre-sim` entry point. A replay holds millions of small objects; freeing them one by one
    at interpreter exit takes seconds, so once the command is done and its output flushed the process
    ends at once (every file it writes is already closed)."""
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)

