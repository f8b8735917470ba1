"""`gyre-sim calibrate`, `gyre-sim replay`, and `run --workload/--trace-out`: traces on the command line.

register(app) adds the two commands. `run` (sim/cli.py) calls `calibrated_source` for
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

from gyre.traces.calibrate import CalibrateOptions, base_config, calibrate, fit_figures, quantities
from gyre.traces.calibrated import CalibratedSource, load_workload
from gyre.traces.readers import Grouping, RequestFields, SessionFields, read_request_csv, read_request_jsonl, read_sessions, sniff
from gyre.traces.schema import Outcome, Trace, TraceError, read_trace, write_trace
from gyre.workload import ReplaySource

FORMATS = ("auto", "rollout", "sessions", "requests-csv", "requests-jsonl")


def load_trace(path: Path, fmt: str = "auto", *, skip_bad: bool = False, grouping: Grouping = Grouping(),
               time_field: str | None = None, input_field: str | None = None, output_field: str | None = None) -> Trace:
    """Read any supported trace format (sniffed when fmt is 'auto')."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    fmt = sniff(path) if fmt == "auto" else fmt
    if fmt == "rollout":
        return read_trace(path, skip_bad=skip_bad)
    if fmt == "sessions":
        sf = SessionFields(**{k: v for k, v in (("time", time_field), ("input", input_field),
                                                ("output", output_field)) if v is not None})
        return read_sessions(path, fields=sf, grouping=grouping, skip_bad=skip_bad)
    default = RequestFields() if fmt == "requests-csv" else RequestFields(time="timestamp", input="input_length",
                                                                           output="output_length")
    rf = RequestFields(time=default.time if time_field is None else time_field, input=input_field or default.input,
                       output=output_field or default.output)
    reader = read_request_csv if fmt == "requests-csv" else read_request_jsonl
    return reader(path, fields=rf, grouping=grouping, skip_bad=skip_bad)


def replay_source(path: str, fmt: str, skip_bad: bool, grouping: Grouping, fields: tuple) -> ReplaySource:
    """A picklable source factory for worker processes: each re-reads the trace (cheap to ship)."""
    import gc

    tr = load_trace(Path(path), fmt, skip_bad=skip_bad, grouping=grouping, time_field=fields[0],
                    input_field=fields[1], output_field=fields[2])
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
    from gyre.sim.cli import fail

    fail(str(exc))


TraceArg = Annotated[Path, typer.Argument(help="trace file: rollout JSONL, session JSONL, request CSV/JSONL")]
Fmt = Annotated[str, typer.Option("--format", help=f"one of {', '.join(FORMATS)}")]
SkipBad = Annotated[bool, typer.Option("--skip-bad", help="skip malformed lines (and report them) instead of stopping")]
GroupSize = Annotated[int, typer.Option("--group-size", help="executions per group (foreign traces)")]
GroupsPerStep = Annotated[int, typer.Option("--groups-per-step", help="groups per step (foreign traces)")]
TimeF = Annotated[Optional[str], typer.Option("--time-field", help="timestamp column/field ('' for none)")]
InF = Annotated[Optional[str], typer.Option("--input-field", help="context/input tokens column/field")]
OutF = Annotated[Optional[str], typer.Option("--output-field", help="generated/output tokens column/field")]


def _load(trace, fmt, skip_bad, group_size, groups_per_step, time_field, input_field, output_field, cap=None):
    from gyre.sim.cli import console

    try:
        g = Grouping(group_size=group_size, groups_per_step=groups_per_step, cap=cap)
        tr = load_trace(trace, fmt, skip_bad=skip_bad, grouping=g, time_field=time_field, input_field=input_field,
                        output_field=output_field)
    except (TraceError, OSError) as exc:
        _fail(exc)
        raise
    if skip_bad:
        console.print(tr.skip_summary(), highlight=False)
    return tr, g


def calibrate_cmd(
    trace: TraceArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="calibrated workload JSON")] = Path("workload.json"),
    fmt: Fmt = "auto",
    split: Annotated[float, typer.Option("--split", help="fitted share, by time; the rest is held out")] = 0.7,
    cap: Annotated[Optional[float], typer.Option("--cap", help="length cap (default: from the trace)")] = None,
    k: Annotated[Optional[int], typer.Option("--k", help="K of 'max over K' (default: batch size)")] = None,
    figures: Annotated[Optional[Path], typer.Option("--figures", help="folder for CDF/QQ figures")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    skip_bad: SkipBad = False, group_size: GroupSize = 8, groups_per_step: GroupsPerStep = 64,
    time_field: TimeF = None, input_field: InF = None, output_field: OutF = None,
) -> None:
    """Fit a workload (empirical body + GPD tail + cap mass, difficulty, drift) to a trace; report held-out fit."""
    from rich.table import Table

    from gyre.sim.cli import console

    tr, _ = _load(trace, fmt, skip_bad, group_size, groups_per_step, time_field, input_field, output_field, cap)
    try:
        cw = calibrate(tr, CalibrateOptions(split=split, cap=cap, k=k, seed=seed))
    except (TraceError, ValueError) as exc:
        _fail(exc)
        raise
    cw.save(out)
    r = cw.report
    console.print(f"{tr.path}: {r['executions']} executions, fitted {r['fitted']}, held out {r['held_out']}; "
                  f"length = {r['scale_target']}, cap {r['cap']}, difficulty sigma {r['difficulty_sigma']:.3f}, "
                  f"drift/step {r['drift_per_step']:+.4f}", highlight=False)
    t = Table(title=f"held-out fit quality (K = {r['k']})")
    cols = ["quantity", "n", "KS D", "W1", "W1/mean", "p50 err", "p90 err", "p99 err", "max-K err", "max-K model/test"]
    for c in cols:
        t.add_column(c, justify="left" if c == "quantity" else "right")
    for name, m in r.get("quality", {}).items():
        t.add_row(name, f"{m['n_test']:.0f}", f"{m['ks_d']:.4f}", f"{m['wasserstein']:.4g}", f"{m['wasserstein_rel']:.3f}",
                  f"{m['p50_err']:.1%}", f"{m['p90_err']:.1%}", f"{m['p99_err']:.1%}", f"{m['maxk_err']:.1%}",
                  f"{m['maxk_model']:.4g}/{m['maxk_test']:.4g}")
    console.print(t)
    if figures is not None and r.get("quality"):
        paths = fit_figures(cw, tr, figures, CalibrateOptions(split=split, cap=cap, k=k, seed=seed))
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
    time_field: TimeF = None, input_field: InF = None, output_field: OutF = None,
    engine: Annotated[Optional[Path], typer.Option("--engine", help="engine calibration JSON (calibrate-engine -o)")] = None,
) -> None:
    """Replay a trace's executions exactly (not resampled) through policies; same comparison as `compare`."""
    from dataclasses import replace

    from gyre.config import ConfigError, override
    from gyre.policies import UnknownPolicy, policy_class
    from gyre.presets import DEFAULT_PRESET, get_preset
    from gyre.sim.cli import _print_table, console
    from gyre.sim.compare import best_per_policy, candidates, comparison_table, run_candidates, write_outputs

    tr, g = _load(trace, fmt, skip_bad, group_size, groups_per_step, time_field, input_field, output_field)
    w = trace_workload(tr)
    whole = len(tr.groups) // w.groups_per_step
    try:
        if whole < 1:
            raise TraceError(f"{trace}: {len(tr.groups)} groups do not fill one step of {w.groups_per_step}")
        if steps is not None and not 1 <= steps <= whole:
            raise TraceError(f"{trace}: --steps {steps} needs 1..{whole} (the trace holds {len(tr.groups)} groups)")
        base = get_preset(preset or tr.run.get("preset") or DEFAULT_PRESET)
        cfg = override(replace(base, workload=w), **{"cluster.gpus": gpus or tr.run.get("gpus"),
                                                     "steps": steps or whole}).validate()
    except (TraceError, ConfigError) as exc:
        _fail(exc)
        raise
    for p in policy or []:
        try:
            policy_class(p)
        except UnknownPolicy as exc:
            _fail(exc)
    from gyre.sim.cli_engine import with_engine

    cfg = with_engine(cfg, engine)
    cands = candidates(cfg, policy)
    if len(cands) == 1:  # runs in this process: replay the trace already read
        def factory():
            return ReplaySource(tr.groups, w)
    else:  # worker processes re-read the trace (cheaper than shipping a million specs to each)
        factory = functools.partial(replay_source, str(trace), fmt, skip_bad, g, (time_field, input_field, output_field))
    try:
        results = run_candidates(cfg, cands, source_factory=factory)
    except (ValueError, IndexError) as exc:
        _fail(exc)
        raise
    best = best_per_policy(cands, results)
    table = comparison_table(best)
    write_outputs(out, cfg, best, table)
    _print_table(table, f"replay of {trace.name} ({tr.n_executions} executions) on {cfg.cluster.gpus} GPUs, "
                        f"{cfg.steps} steps")
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
