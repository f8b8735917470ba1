"""`gyre-sim calibrate`, `gyre-sim replay`, and `run --workload/--trace-out`: traces on the command line.

register(app) adds the two commands. `run` (sim/cli/app.py) calls `calibrated_source` for
`--workload workload.json` (a calibrated workload, gyre.traces.calibrated, instead of the preset's)
and `write_run_trace` for `--trace-out trace.jsonl` (the finished run as a rollout trace: every
issued group, in issue order, so replaying it reproduces the run).

Replay feeds the trace's executions, unchanged and in order, to each policy (gyre.workload.
ReplaySource); steps default to the whole groups_per_step batches the trace holds. Every bad input
is one line, `file:line: reason`, and exit code 2.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from gyre.gc_pause import no_gc
from gyre.traces.calibrated import CalibratedSource, load_workload
from gyre.traces.formats import FORMATS, FieldNames, load_trace
from gyre.traces.heldout import UNITS, fit_figures, quantities
from gyre.traces.readers import TIME_UNITS, Grouping
from gyre.traces.schema import Outcome, Trace, TraceError, write_trace
from gyre.traces.workload_fit import DRIFT_MODES, WorkloadFitOptions, base_config, fit_workload
from gyre.workload import ReplaySource

def replay_source(path: str, fmt: str, skip_bad: bool, grouping: Grouping, names: FieldNames) -> ReplaySource:
    """A picklable source factory for worker processes: each re-reads the trace (cheap to ship)."""
    import gc

    tr = load_trace(Path(path), fmt, names=names, skip_bad=skip_bad, grouping=grouping)
    gc.freeze()  # the trace lives for the whole run: keep the collector from rescanning it
    return ReplaySource(tr.groups, trace_workload(tr))


def trace_workload(tr: Trace):
    """The WorkloadConfig a replay runs under: the trace's own, or one derived from its data."""
    if tr.workload is not None:
        return tr.workload
    multi = any(len(e.gen) > 1 for g in tr.groups[:64] for e in g.executions)
    return base_config(tr, tr.groups, quantities(tr.groups, "turns" if multi else "gen"), math.inf)


def outcomes_from_log(log: list[tuple], groups) -> dict[int, Outcome]:
    """Per-execution outcomes of a simulated run: first policy version, deadline hit, times."""
    start = {r[2]: r[1] for r in log if r[0] == "start"}
    fin = {r[2]: (r[1], r[3], r[4]) for r in log if r[0] == "finish"}
    version = {r[2]: r[4] - r[5] for r in log if r[0] == "trained"}
    out = {}
    for g in groups:
        for s in g.executions:
            t, trunc, generated = fin.get(s.exec_id, (None, None, None))
            out[s.exec_id] = Outcome(
                version=version.get(s.exec_id), start_s=start.get(s.exec_id), end_s=t,
                deadline_hit=None if trunc is None else bool(trunc) and generated < sum(s.gen),
            )
    return out


def write_run_trace(result, path: Path, preset: str | None = None) -> int:
    """Write a SimResult as a rollout trace (header carries what replay needs)."""
    cfg = result.config
    run = {"preset": preset, "policy": result.policy, "gpus": cfg.cluster.gpus, "model": cfg.cluster.model.name,
           "steps": cfg.steps, "seed": cfg.seed, "makespan_s": result.makespan_s}
    return write_trace(path, result.groups, workload=cfg.workload, run=run,
                       outcomes=outcomes_from_log(result.log, result.groups))


def _fail(exc: Exception) -> None:
    from rich.markup import escape

    from gyre.sim.cli.console import fail

    fail(escape(str(exc)))  # a record's text (e.g. "[1, 2]") is not console markup


TraceArg = Annotated[Path, typer.Argument(help="trace file: rollout JSONL, session JSONL, request CSV/JSONL")]
Fmt = Annotated[str, typer.Option("--format", help=f"one of {', '.join(FORMATS)}")]
SkipBad = Annotated[bool, typer.Option("--skip-bad", help="skip malformed lines (and report them) instead of stopping")]
GroupSize = Annotated[int, typer.Option("--group-size", help="executions per group (foreign traces)")]
GroupsPerStep = Annotated[int, typer.Option("--groups-per-step", help="groups per step (foreign traces)")]
TimeF = Annotated[Optional[str], typer.Option("--time-field", help="timestamp column/field ('' for none)")]
InF = Annotated[Optional[str], typer.Option("--input-field", help="context/input tokens column/field")]
OutF = Annotated[Optional[str], typer.Option("--output-field", help="generated/output tokens column/field")]
SessF = Annotated[Optional[str], typer.Option("--sessions-field", help="a session's list of sub-requests")]
ToolF = Annotated[Optional[str], typer.Option("--tool-field", help="a sub-request's tool duration field")]
TaskF = Annotated[Optional[str], typer.Option("--task-field", help="a session's task field (default task_id): "
                                                                   "the sessions of one task form one group")]
ROWS = ("all", "requested")
RowsOpt = Annotated[str, typer.Option("--rows", help="all: each policy's per-eta rows and pilot too; requested: "
                                                     "one row per policy named")]


def _rows_ok(rows: str) -> None:
    if rows not in ROWS:
        _fail(ValueError(f"unknown --rows {rows!r}; known: {', '.join(ROWS)}"))
TimeU = Annotated[str, typer.Option("--time-unit", help=f"unit of numeric timestamps: {', '.join(TIME_UNITS)}")]
ToolU = Annotated[str, typer.Option("--tool-unit", help=f"unit of tool durations: {', '.join(TIME_UNITS)}")]
# run, compare and replay: injected faults (gyre.faults)
FaultsOpt = Annotated[Optional[list[str]], typer.Option(
    "--faults", help="inject a fault (repeatable): kill-engine@T, kill-trainer@T (T: simulated seconds), "
    "random-engines:N, random-trainers:N (moments drawn from --seed), delay-sync:S@T, drop-sync@T")]
CheckpointEveryOpt = Annotated[Optional[int], typer.Option(
    "--checkpoint-every", help="trainer checkpoint every N steps (0: none): a lost trainer state is rebuilt from "
    "the last one")]


FEW_EXECUTIONS = 8  # fewer executions than one default group: warned about


def _load(trace, fmt, skip_bad, group_size, groups_per_step, names: FieldNames, cap=None):
    from gyre.sim.cli.console import console, err_console

    try:
        g = Grouping(group_size=group_size, groups_per_step=groups_per_step, cap=cap)
        tr = load_trace(trace, fmt, names=names, skip_bad=skip_bad, grouping=g)
    except (TraceError, OSError) as exc:
        _fail(exc)
        raise
    if skip_bad:
        console.print(tr.skip_summary(), highlight=False)
    for note in tr.notes:
        console.print(f"note: {note}", highlight=False)
    if tr.n_executions < FEW_EXECUTIONS:
        err_console.print(f"warning: {tr.path} holds only {tr.n_executions} executions: a workload fitted or "
                          "replayed from so few says little", highlight=False)
    return tr, g


def _names(time_field, input_field, output_field, sessions_field, tool_field, time_unit, tool_unit,
           task_field=None) -> FieldNames:
    try:
        n = FieldNames(time=time_field, input=input_field, output=output_field, sessions=sessions_field,
                       tool=tool_field, time_unit=time_unit, tool_unit=tool_unit, task=task_field)
        n.session(), n.requests("requests-jsonl")  # validates the units
    except TraceError as exc:
        _fail(exc)
        raise
    return n


def _pct(m: dict, key: str) -> str:
    return f"{m[key]:.1%}" if key in m else "-"


def print_report(r: dict) -> None:
    """The calibration summary: drift decision, tails, and the held-out fit table (or why there is none)."""
    from rich.table import Table

    from gyre.sim.cli.console import console

    d = r.get("drift", {})
    console.print(f"{r['trace']}: {r['executions']} executions, fitted {r['fitted']}, held out {r['held_out']}; "
                  f"length = {r['scale_target']}, cap {r['cap']}, difficulty sigma {r['difficulty_sigma']:.3f} "
                  f"({r.get('difficulty', '')}), "
                  f"drift/step {r['drift_per_step']:+.4f} ({d.get('why', '')})", highlight=False)
    if r.get("recent", {}).get("chosen", 1.0) < 1.0:
        console.print(f"  fitted on the most recent {r['recent']['chosen']:.0%}: {r['recent']['why']}", highlight=False)
    for name, t in r.get("tails", {}).items():
        shape = f"GPD above {t['u']:g} (xi {t['xi']:.3f}, {t['p_tail']:.1%} of values)" if t.get("xi") is not None \
            else ("empirical tail" if t["kind"] == "tail" else "log-normal mixture")
        clamp = f", clamped at {t['clamp']:.0f}" if t.get("clamp") is not None else ""
        note = f"; {t['note']}" if t.get("note") else ""
        console.print(f"  {name}: {shape}{clamp}{note}", highlight=False)
    st = r.get("stationarity")
    if st:
        console.print(f"  stationarity: {st['verdict']}: {st['why']}", highlight=False)
    if not r.get("quality"):
        console.print(f"no held-out data (--split {r['split']}): fit quality not measured", highlight=False)
        return
    t = Table(title="fit quality: the calibrated model against the fitted data and the held-out data "
                    f"(max-of-K: mean max of K draws, K = min({r['k']}, held-out n))")
    cols = ["quantity", "unit", "n held", "K", "KS fit", "KS held", "KS perfect", "KS data", "p50 err", "p99 err",
            "max-of-K err", "max-of-K model/held"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("quantity", "unit") else "right")
    for name, m in r["quality"].items():
        mk = m.get("marks", {})
        t.add_row(name, UNITS.get(name, ""), f"{m['n_test']:.0f}", f"{m['k']:.0f}",
                  f"{m['ks_fit']:.3f}" if "ks_fit" in m else "-", _marked(f"{m['ks_d']:.3f}", mk.get("ks_d")),
                  f"{m['ks_perfect']:.3f}" if "ks_perfect" in m else "-",
                  f"{m['ks_data']:.3f}" if "ks_data" in m else "-", _pct(m, "p50_err"),
                  _marked(_pct(m, "p99_err"), mk.get("p99_err")), _marked(_pct(m, "maxk_mean_err"),
                                                                         mk.get("maxk_mean_err")),
                  f"{m.get('maxk_mean_model', float('nan')):.4g}/{m.get('maxk_mean_test', float('nan')):.4g}")
    console.print(t)
    console.print("targets: KS D <= 0.10, p99 and max-of-K within 15% (ok / MISS). KS perfect: what a perfect model "
                  "shows at the held-out n (0.87/sqrt(n)); KS data: the held-out data against the fitted data "
                  "themselves (no stationary model does better).", highlight=False)
    console.print(f"verdict: {r.get('verdict', '')}", highlight=False)


def _marked(text: str, ok: bool | None) -> str:
    return text if ok is None else f"{text} {'ok' if ok else 'MISS'}"


def calibrate_cmd(
    trace: TraceArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="calibrated workload JSON")] = Path("workload.json"),
    fmt: Fmt = "auto",
    split: Annotated[float, typer.Option("--split", help="fitted share, by time; the rest is held out")] = 0.7,
    cap: Annotated[Optional[float], typer.Option("--cap", help="length cap (default: from the trace)")] = None,
    k: Annotated[Optional[int], typer.Option("--k", help="K of 'max over K' (default: batch size)")] = None,
    figures: Annotated[Optional[Path], typer.Option("--figures", help="folder for CDF/QQ figures")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    drift: Annotated[str, typer.Option("--drift", help=f"length drift over steps: {', '.join(DRIFT_MODES)} (auto: "
                                                       "kept only where it improves the held-out fit; off for "
                                                       "request/session traces)")] = "auto",
    recent: Annotated[str, typer.Option("--recent", help="request/session traces: all (every fitted execution), "
                                                         "or auto (the most recent half or quarter when it "
                                                         "predicts what follows better in most validation "
                                                         "windows and worse in none)")] = "all",
    skip_bad: SkipBad = False, group_size: GroupSize = 8, groups_per_step: GroupsPerStep = 64,
    time_field: TimeF = None, input_field: InF = None, output_field: OutF = None, sessions_field: SessF = None,
    tool_field: ToolF = None, time_unit: TimeU = "s", tool_unit: ToolU = "ns", task_field: TaskF = None,
) -> None:
    """Fit a workload (empirical body + GPD tail + cap mass, difficulty, drift) to a trace; report held-out fit."""
    from gyre.sim.cli.console import console

    names = _names(time_field, input_field, output_field, sessions_field, tool_field, time_unit, tool_unit,
                   task_field)
    tr, _ = _load(trace, fmt, skip_bad, group_size, groups_per_step, names, cap)
    try:
        opts = WorkloadFitOptions(split=split, cap=cap, k=k, seed=seed, drift=drift, recent=recent)
        cw = fit_workload(tr, opts)
    except (TraceError, ValueError) as exc:
        _fail(exc)
        raise
    cw.save(out)
    print_report(cw.report)
    if figures is not None and cw.report.get("quality"):
        paths = fit_figures(cw, tr, figures, opts)
        console.print(f"wrote {', '.join(p.name for p in paths)} in {figures}/")
    console.print(f"wrote {out}")


def replay_cmd(
    trace: TraceArg,
    policy: Annotated[Optional[list[str]], typer.Option("--policy", help="policies to replay through")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", "-p", help="cluster preset (default: the trace's)")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the cluster")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="steps (default: all whole batches)")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="results folder")] = Path("out/replay"),
    fmt: Fmt = "auto", skip_bad: SkipBad = False, group_size: GroupSize = 8, groups_per_step: GroupsPerStep = 64,
    time_field: TimeF = None, input_field: InF = None, output_field: OutF = None, sessions_field: SessF = None,
    tool_field: ToolF = None, time_unit: TimeU = "s", tool_unit: ToolU = "ns",
    engine: Annotated[Optional[Path], typer.Option("--engine", help="engine calibration JSON (calibrate-engine -o)")] = None,
    faults: FaultsOpt = None,
    checkpoint_every: CheckpointEveryOpt = None,
    partial: Annotated[bool, typer.Option("--partial", help="run a trace smaller than one step as one partial "
                                                            "step (else it stops with the counts)")] = False,
    rows: RowsOpt = "all",
    task_field: TaskF = None,
) -> None:
    """Replay a trace's executions exactly (not resampled) through policies; same comparison as `compare`."""
    names = _names(time_field, input_field, output_field, sessions_field, tool_field, time_unit, tool_unit,
                   task_field)
    _rows_ok(rows)
    with no_gc():  # a million executions and their run's log live to the end: see gyre.gc_pause
        _replay(trace, policy, preset, gpus, steps, out, fmt, skip_bad, group_size, groups_per_step, names, engine,
                faults, checkpoint_every, partial, rows)


def partial_step(tr: Trace, g: Grouping) -> str:
    """'' when a foreign trace fills at least one step of the grouping flags; else the one-line reason, with the
    counts and the flags that would fit it (a rollout trace carries its own batch: '' always)."""
    if tr.workload is not None or len(tr.groups) >= g.groups_per_step:
        return ""
    n, gs = tr.n_executions, len(tr.groups)
    if tr.task_groups:
        fits = [d for d in (gs, gs // 2, gs // 4) if d >= 1]
        return (f"{tr.path}: {gs} tasks ({n} executions) fill no step of {g.groups_per_step} groups; "
                f"--groups-per-step {' or '.join(f'{d} ({gs // d} steps)' for d in dict.fromkeys(fits))} fits it, "
                f"or --partial runs them as one partial step")
    need = g.groups_per_step * g.group_size
    fits = [(p, s) for p, s in ((gs, 1), (gs // 2, 2), (gs // 4, 4)) if p >= 1]
    return (f"{tr.path}: {n} executions fill no step of {g.groups_per_step} groups x {g.group_size} ({need}); "
            f"{' or '.join(f'--groups-per-step {p} ({s} steps)' for p, s in dict.fromkeys(fits))} "
            f"with --group-size {g.group_size} fits it, or --partial runs them as one partial step")


def _replay(trace, policy, preset, gpus, steps, out, fmt, skip_bad, group_size, groups_per_step, names,
            engine=None, faults=None, checkpoint_every=None, partial=False, rows="all") -> None:
    from dataclasses import replace

    from gyre.config import ConfigError, override
    from gyre.policies import UnknownPolicy, policy_class
    from gyre.presets import DEFAULT_PRESET, get_preset
    from gyre.sim.cli.console import console, err_console, print_table
    from gyre.sim.harness.compare import candidates, requested_rows, run_title, tune, tuned_table, write_outputs

    from gyre.faults import spec_error

    bad = spec_error(faults or [])
    if bad:
        _fail(ValueError(bad))
    tr, g = _load(trace, fmt, skip_bad, group_size, groups_per_step, names)
    w = trace_workload(tr)
    whole = len(tr.groups) // w.groups_per_step
    try:
        short = partial_step(tr, g)
        if short and not partial:
            raise TraceError(short)
        if short:
            err_console.print(f"warning: {short.split(': ', 1)[1].split('; ')[0]}; running it as one partial step "
                              "(--partial)", highlight=False)
        if whole < 1:
            raise TraceError(f"{trace}: {len(tr.groups)} groups do not fill one step of {w.groups_per_step}")
        if steps is not None and not 1 <= steps <= whole:
            raise TraceError(f"{trace}: --steps {steps} needs 1..{whole} (the trace holds {len(tr.groups)} groups)")
        base = get_preset(preset or tr.run.get("preset") or DEFAULT_PRESET)
        cfg = override(replace(base, workload=w), **{"cluster.gpus": gpus or tr.run.get("gpus"),
                                                     "steps": steps or whole, "checkpoint_every": checkpoint_every,
                                                     "faults": tuple(faults) if faults else None}).validate()
    except (TraceError, ConfigError) as exc:
        _fail(exc)
        raise
    for p in policy or []:
        try:
            policy_class(p)
        except UnknownPolicy as exc:
            _fail(exc)
    from gyre.sim.cli.calibrate_engine import with_engine

    cfg = with_engine(cfg, engine)
    from gyre.sim.cli.console import report_infeasible

    report_infeasible(cfg, policy)
    cands = candidates(cfg, policy)
    if len(cands) == 1:  # runs in this process: replay the trace already read
        def factory():
            return ReplaySource(tr.groups, w)
    else:  # worker processes re-read the trace (cheaper than shipping a million specs to each)
        factory = functools.partial(replay_source, str(trace), fmt, skip_bad, g, names)
    try:
        tuned = tune(cfg, policy, source_factory=factory, workers=1 if len(cands) == 1 else None)
    except (ValueError, IndexError) as exc:
        _fail(exc)
        raise
    best, table, sweep = tuned_table(tuned)
    if rows == "requested":
        table = requested_rows(table, policy)
        best = {k: best[k] for k in table["policy"]}
    write_outputs(out, cfg, best, table, sweep)
    used = tr.groups[: cfg.steps * w.groups_per_step]
    n_used = sum(len(x.executions) for x in used)
    print_table(table, f"replay of {trace.name}: {n_used:,} of {tr.n_executions:,} executions ({len(used):,} groups, "
                       f"{cfg.steps} steps) on {run_title(cfg)}")
    console.print(f"wrote {out}/")


def calibrated_source(cfg, workload: Path):
    """(config with the calibrated workload, its source) for `gyre-sim run --workload`."""
    from dataclasses import replace

    cw = load_workload(workload)
    cfg = replace(cfg, workload=cw.base).validate()
    return cfg, CalibratedSource(cw, cfg.seed)


def register(app: typer.Typer) -> None:
    """Add `calibrate` and `replay` (`run --workload/--trace-out` call into this module)."""
    app.command("calibrate")(calibrate_cmd)
    app.command("replay")(replay_cmd)
