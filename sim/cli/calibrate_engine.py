"""`gyre-sim calibrate-engine`: fit the engine step cost to a real vLLM run and say how well it fits.

    gyre-sim calibrate-engine RUN_DIR -o engine.json [--report report.json] [--figures DIR] [--split 0.7]
    gyre-sim calibrate-engine RUN_DIR --engine engine.json [--report ...] [--figures ...]
    ... [--model NAME | --model-config config.json] [--gpu NAME]

The first fits the coefficients on the first `--split` of requests by arrival and reports on the
rest; the second fits nothing and reports the given calibration (from any GPU or model: applied
with this run's own presets) on the whole run. Both also report the uncalibrated model (specs only).
`--report` holds exactly `calibrated` and `uncalibrated`, each with METRICS (fractions).
Every bad input is one line naming the file and line or field, exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer

from gyre.sim.vllm_check.engine_fit import METRICS, fit_report, coef_dict, engine_json, load_engine
from gyre.sim.vllm_check.serving_run import Run, RunError, read_run


def _fail(exc: Exception) -> None:
    from gyre.sim.cli.console import fail

    fail(str(exc))


def latency_figure(run: Run, rep: dict[str, Any], path: Path) -> Path:
    """Predicted vs measured end-to-end latency and TTFT per request (calibrated and uncalibrated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    req, test = run.requests, rep["_test"]
    held = np.zeros(len(req), dtype=bool)
    held[test] = True
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, (label, meas, pred_of) in zip(axes, (
            ("end-to-end latency (s)", req.e2e, lambda r: r.last_token - req.queued),
            ("time to first token (s)", req.ttft, lambda r: r.first_token - req.queued))):
        for name, marker in (("uncalibrated", "x"), ("calibrated", "o")):
            pred = pred_of(rep["_results"][name])
            for mask, what, alpha in ((~held, "fitted", 0.35), (held, "held out" if (~held).any() else "all", 0.9)):
                if mask.any():
                    ax.scatter(meas[mask], pred[mask], s=9, marker=marker, alpha=alpha, label=f"{name}, {what}")
        hi = max(meas.max(), max(pred_of(r).max() for r in rep["_results"].values()))
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{run.path.name}: replay vs real vLLM (data: LLMServingSim, MIT)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def running_at(res, t: np.ndarray) -> np.ndarray:
    """Running requests of a replay at times t (the last step started at or before each)."""
    i = np.searchsorted(res.running_t, t, side="right") - 1
    return np.where(i >= 0, res.running_n[np.maximum(i, 0)], 0)


def running_figure(run: Run, rep: dict[str, Any], path: Path) -> Path:
    """Running requests over time: the replays against timeseries.csv (t = 0 at the first arrival)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    if run.timeseries is not None:
        ax.step(run.timeseries["t"], run.timeseries["running"], where="post", color="k", lw=1.4,
                label="vLLM (timeseries.csv)")
    horizon = max(float(r.last_token.max()) for r in rep["_results"].values())
    grid = np.linspace(0.0, horizon, 800)
    for name in ("calibrated", "uncalibrated"):
        ax.step(grid, running_at(rep["_results"][name], grid), where="post", lw=1.0, label=f"replay, {name}")
    start, finish = rep["_simulator"]
    live = (start[None, :] <= grid[:, None]) & (grid[:, None] < finish[None, :])
    ax.step(grid, live.sum(axis=1), where="post", lw=1.0, ls="--", label="simulator's engine, calibrated")
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("running requests")
    ax.set_title(f"{run.path.name} (data: LLMServingSim, MIT)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def calibrate_engine_cmd(
    run_dir: Annotated[Path, typer.Argument(help="vLLM run: meta.json, requests.jsonl, timeseries.csv")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="engine calibration JSON to write")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="error report JSON")] = None,
    figures: Annotated[Optional[Path], typer.Option("--figures", help="folder for the figures")] = None,
    split: Annotated[float, typer.Option("--split", help="fitted share of requests, by arrival")] = 0.7,
    engine: Annotated[Optional[Path], typer.Option("--engine", help="apply this calibration; fit nothing")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="model preset (default: meta.json's id)")] = None,
    model_config: Annotated[Optional[Path], typer.Option(
        "--model-config", help="Hugging Face config.json of the model (default: config.json beside the run)")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU preset (default: meta.json's device name, "
                                                             "else the folder name <gpu>_<model>)")] = None,
) -> None:
    """Fit the engine cost model to a real vLLM run's logs; report held-out errors (or apply --engine's)."""
    from rich.table import Table

    from gyre.sim.cli.console import console

    try:
        run = read_run(run_dir, model=model, model_config=model_config, gpu=gpu)
        coeffs = load_engine(engine) if engine is not None else None
        if coeffs is None and not 0.0 < split < 1.0:
            raise RunError(f"--split must be in (0, 1), got {split}")
        rep = fit_report(run, split, coeffs)
    except RunError as exc:
        _fail(exc)
        raise
    fitted = engine is None
    t = Table(title=f"{run.path.name}: {run.model} on {run.engine.tensor_parallel} x {run.gpu} "
                    f"(DP {run.engine.data_parallel}); errors on {rep['test_requests']} "
                    f"{'held-out requests' if fitted else 'requests (all)'}")
    t.add_column("model")
    for m in METRICS:
        t.add_column(m, justify="right")
    for name in ("calibrated", "uncalibrated"):
        label = name if fitted or name == "uncalibrated" else engine.name
        t.add_row(label, *(f"{rep[name][m]:.1%}" for m in METRICS))
    console.print(t)
    sim = rep["simulator"]
    console.print(f"the simulator's engine (gyre.sim.cluster.engine) with these coefficients: e2e median "
                  f"{sim['e2e_median_rel_err']:.1%}, p90 {sim['e2e_p90_rel_err']:.1%}, "
                  f"makespan {sim['makespan_rel_err']:.1%}",
                  highlight=False)
    console.print("coefficients: " + ", ".join(f"{k} = {v:.4g}" + ("" if k in rep["fitted"] else " (not fitted)")
                                               for k, v in coef_dict(rep["coef"]).items()), highlight=False)
    try:
        _write(run, rep, out if out is not None or not fitted else Path("engine.json"), report, figures, fitted)
    except OSError as exc:
        _fail(exc)
        raise


def _write(run: Run, rep: dict[str, Any], out: Path | None, report: Path | None, figures: Path | None,
           fitted: bool) -> None:
    from gyre.sim.cli.console import console

    if out is not None:  # fitted: the fit; with --engine: the applied coefficients and their errors on this run
        public = {k: rep[k] for k in ("calibrated", "uncalibrated", "simulator", "fit_requests", "fit_loss",
                                      "test_requests") if k in rep}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(engine_json(rep["coef"], run, rep["fitted"], public, applied=not fitted), indent=2)
                       + "\n")
        console.print(f"wrote {out}")
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({k: rep[k] for k in ("calibrated", "uncalibrated")}, indent=2) + "\n")
        console.print(f"wrote {report}")
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        paths = [latency_figure(run, rep, figures / "latency.png"), running_figure(run, rep, figures / "running.png")]
        console.print(f"wrote {', '.join(p.name for p in paths)} in {figures}/")


EngineOpt = Annotated[Optional[Path], typer.Option("--engine", help="engine calibration JSON (calibrate-engine -o)")]


def with_engine(cfg, engine: Path | None):
    """`cfg` with its engine step coefficients from an engine.json (`run`, `compare`, `replay --engine`)."""
    if engine is None:
        return cfg
    from dataclasses import replace

    try:
        coef = load_engine(engine, cfg.cluster.cost.engine)
    except RunError as exc:
        _fail(exc)
        raise
    return replace(cfg, cluster=replace(cfg.cluster, cost=replace(cfg.cluster.cost, engine=coef))).validate()


def register(app: typer.Typer) -> None:
    app.command("calibrate-engine")(calibrate_engine_cmd)
