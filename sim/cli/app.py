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


def build_config(preset: str, gpus: int | None, steps: int | None, seed: int | None, eta: int | None = None,
                 policies: list[str] | None = None, faults: list[str] | None = None,
                 checkpoint_every: int | None = None, j_max: str | None = None,
                 role_priority: str | None = None) -> RunConfig:
    """The preset with the flags applied; `eta` goes to the named policies (default: every one that has it);
    `j_max` (an integer or "uncapped") or `role_priority` (comma-separated roles) turn role-bounded sampling on."""
    bad = spec_error(faults or [])
    if bad:
        fail(bad)
    try:
        for p in policies or []:
            policy_class(p)
        cfg = override(get_preset(preset), **{"cluster.gpus": gpus, "steps": steps, "seed": seed,
                                              "faults": tuple(faults) if faults else None,
                                              "checkpoint_every": checkpoint_every})
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
    j_max: JMax = None,
    role_priority: RolePriority = None,
) -> None:
    """Simulate one policy and write its metrics."""
    from gyre.sim.harness.compare import Candidate, comparison_table, write_outputs
    from gyre.sim.harness.runner import simulate

    cfg = calibrate_engine.with_engine(build_config(preset, gpus, steps, seed, eta, [policy], faults, checkpoint_every,
                                                    j_max, role_priority),
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
    print_table(table, f"{policy} on {cfg.workload.name}, {cfg.cluster.model.name} ({cfg.cluster.gpus} GPUs, {cfg.steps} steps)")
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
) -> None:
    """Run every registered policy on the same workload and seed, each tuned (async also on a pilot)."""
    from gyre.sim.harness.compare import tune, tuned_table, write_outputs

    cfg = calibrate_engine.with_engine(build_config(preset, gpus, steps, seed, policies=policy, faults=faults,
                                                    checkpoint_every=checkpoint_every, j_max=j_max,
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
    paths = write_outputs(out, cfg, best, table, sweep)
    print_table(table, f"{cfg.name}: {cfg.cluster.gpus} GPUs, {cfg.steps} steps, seed {cfg.seed}")
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

