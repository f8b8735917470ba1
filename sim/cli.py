"""`gyre-sim`: run, compare and inspect scheduling policies in the simulator.

Every flag overrides one field of a named preset; user errors exit with code 2 and one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gyre.config import ConfigError, RunConfig, override
from gyre.faults import spec_error
from gyre.policies import REGISTRY, UnknownPolicy, baselines, check_params, policy_class, takes
from gyre.presets import DEFAULT_PRESET, MODELS, PRESETS, get_preset
from gyre.sim import cli_engine, cli_traces

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Gyre simulator: compare RL scheduling policies.")
console = Console(width=None if sys.stdout.isatty() else 140)


def fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def build_config(preset: str, gpus: int | None, steps: int | None, seed: int | None, eta: int | None = None,
                 policies: list[str] | None = None, faults: list[str] | None = None,
                 checkpoint_every: int | None = None) -> RunConfig:
    """The preset with the flags applied; `eta` goes to the named policies (default: every one that has it)."""
    bad = spec_error(faults or [])
    if bad:
        fail(bad)
    try:
        for p in policies or []:
            policy_class(p)
        cfg = override(get_preset(preset), **{"cluster.gpus": gpus, "steps": steps, "seed": seed,
                                              "faults": tuple(faults) if faults else None,
                                              "checkpoint_every": checkpoint_every})
        if eta is not None:
            targets = policies or [p for p in REGISTRY if takes(p, "eta")]
            params = {p: {**cfg.policy_params.get(p, {}), "eta": eta} for p in targets}
            cfg = override(cfg, policy_params={**cfg.policy_params, **params})
        check_params(cfg.policy_params)
        return cfg.validate()
    except (ConfigError, UnknownPolicy) as exc:
        fail(str(exc))
        raise


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


Preset = Annotated[str, typer.Option("--preset", "-p", help="named preset (gyre-sim presets)")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the cluster")]
Steps = Annotated[Optional[int], typer.Option("--steps", help="training steps")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="workload seed")]
Out = Annotated[Path, typer.Option("--out", "-o", help="results folder")]
Faults = cli_traces.FaultsOpt
CheckpointEvery = cli_traces.CheckpointEveryOpt


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
    engine: cli_engine.EngineOpt = None,
    faults: Faults = None,
    checkpoint_every: CheckpointEvery = None,
) -> None:
    """Simulate one policy and write its metrics."""
    from gyre.sim.compare import Candidate, comparison_table, write_outputs
    from gyre.sim.runner import simulate

    cfg = cli_engine.with_engine(build_config(preset, gpus, steps, seed, eta, [policy], faults, checkpoint_every),
                                 engine)
    with _progress() as prog:
        task = prog.add_task(f"{policy} on {cfg.name}", total=cfg.steps)
        try:
            source = None
            if workload is not None:
                cfg, source = cli_traces.calibrated_source(cfg, workload)
            r = simulate(cfg, policy, source=source, progress=lambda v, t: prog.update(task, completed=v))
        except (UnknownPolicy, ValueError, OSError) as exc:
            fail(str(exc))
            raise
    if trace_out is not None:
        n = cli_traces.write_run_trace(r, trace_out, preset)
        console.print(f"wrote {trace_out} ({n} executions)")
    best = {r.policy: (Candidate(r.policy, cfg.policy_params.get(policy, {})), r)}
    table = comparison_table(best)
    write_outputs(out, cfg, best, table)
    _print_table(table, f"{policy} on {cfg.workload.name}, {cfg.cluster.model.name} ({cfg.cluster.gpus} GPUs, {cfg.steps} steps)")
    console.print(f"wrote {out}/")


@app.command()
def compare(
    preset: Preset = DEFAULT_PRESET,
    gpus: Gpus = None,
    steps: Steps = None,
    seed: Seed = None,
    policy: Annotated[Optional[list[str]], typer.Option("--policy", help="restrict to these policies")] = None,
    out: Out = Path("out/compare"),
    engine: cli_engine.EngineOpt = None,
    faults: Faults = None,
    checkpoint_every: CheckpointEvery = None,
) -> None:
    """Run every registered policy on the same workload and seed, each tuned (async also on a pilot)."""
    from gyre.sim.compare import tune, tuned_table, write_outputs

    cfg = cli_engine.with_engine(build_config(preset, gpus, steps, seed, policies=policy, faults=faults,
                                              checkpoint_every=checkpoint_every), engine)
    _report_infeasible(cfg, policy)
    with _progress() as prog:
        task = prog.add_task(f"tuning on {cfg.name}", total=None)
        tuned = tune(cfg, policy, on_done=lambda c, r: prog.advance(task))
    best, table, sweep = tuned_table(tuned)
    paths = write_outputs(out, cfg, best, table, sweep)
    _print_table(table, f"{cfg.name}: {cfg.cluster.gpus} GPUs, {cfg.steps} steps, seed {cfg.seed}")
    console.print(f"wrote {paths['summary']}, {paths['timeline'].name}, {paths['utilization'].name}, "
                  f"{paths['gpu_hours'].name} in {out}/")


def _report_infeasible(cfg, policies) -> None:
    """Say which policies this cluster cannot run (they are left out); fail if that is all of them."""
    from gyre.policies import REGISTRY
    from gyre.sim.compare import infeasible

    skip = infeasible(cfg, policies)
    for name, why in skip.items():
        console.print(f"skipped {name}: {why}")
    if skip and len(skip) == len(policies or REGISTRY):
        fail(f"no policy can run on this cluster ({', '.join(skip)})")


def _duration(s: float) -> str:
    """'2.31 h', '12.4 min' or '41.0 s' (a sub-hour run does not print as 0.00 h)."""
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def _ratio(r, key: str, digits: int = 2) -> str:
    v = r.get(key, float("nan"))
    return "-" if v != v else f"{v:.{digits}f}x"  # NaN: that policy was not run


def _count(r, key: str) -> str:
    v = r.get(key, float("nan"))
    return "-" if v != v else f"{int(v):,}"


def _print_table(table, title: str) -> None:
    t = Table(title=title)
    bases = baselines()
    same = [b for b in bases if f"speedup_vs_{b}_same_eta" in table]
    others = [b for b in bases if b not in same]  # a baseline with no eta (colocate: eta 0)
    cols = ["policy", "config", "per engine", "time", *(f"vs {b} @eta" for b in same),
            *(f"vs {b}" for b in others), "vs best", "equal work", "cut", "sched cut", "tokens", "preempt",
            "stale"]
    left = ("policy", "config")
    width = max(map(len, table["config"]), default=6)
    for c in cols:
        t.add_column(c, justify="left" if c in left else "right", no_wrap=c in ("policy", "config"),
                     min_width=width if c == "config" else None)
    for _, r in table.iterrows():
        t.add_row(
            r["policy"], r["config"], _count(r, "engine_limit"), _duration(r["makespan_s"]),
            *(_ratio(r, f"speedup_vs_{b}_same_eta", 3) for b in same), *(_ratio(r, f"speedup_vs_{b}", 3) for b in others),
            _ratio(r, "speedup_vs_best", 3), "yes" if r.get("equal_work", True) else "NO",
            _count(r, "deadline_hit"), _count(r, "sched_cuts"), f"{r['tokens_generated'] / 1e6:.0f}M",
            _count(r, "preemptions"), str(r["staleness_max"]),
        )
    console.print(t)
    console.print("tuned: " + "; ".join(f"{r['policy']}: {r.get('tuned', '')}" for _, r in table.iterrows()),
                  highlight=False)
    n = int(table["executions"].max()) if "executions" in table else 0
    console.print(f"lower bound: {_duration(table['bound_s'].iloc[0])} (max of GPU-work / N and critical path; "
                  "each row's vs_bound and vs_eta_bound are in summary.csv); "
                  "vs <baseline> same eta: speedup over that baseline's best at the row's eta; "
                  "vs best: over the fastest equal-work baseline tuned with hindsight; "
                  f"cut: executions cut by their deadline, sched cuts: those that would have finished in time "
                  f"alone on an idle engine. Equal work: rows ranked only among those whose sched cuts exceed "
                  f"the least by at most 1% of the run's {n:,} executions; a row marked NO is never the best.",
                  highlight=False)


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


cli_traces.register(app)
cli_engine.register(app)


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

