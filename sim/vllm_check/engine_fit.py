"""Fit and check the engine step cost against a real vLLM run: errors, fit, engine.json.

The replay (vllm_scheduler) runs every request of the run through the simulator's own step cost
(gyre.roofline.EngineRoofline, built by gyre.hardware.engine_roofline from the run's GPU and model
presets, its tensor-parallel size and, for an MoE served with enable_expert_parallel, its experts spread
over all data-parallel replicas' GPUs with the replicas stepping in lockstep). The coefficients fitted (gyre.roofline.Coefficients) are the
efficiencies of weight reads, KV reads and compute and the fixed step overhead, plus the all-reduce
latency when the run is tensor or expert parallel (otherwise no step depends on it and it keeps its default);
they are fitted to
the first `split` of requests by arrival and judged on the rest, next to the uncalibrated model (the
coefficients' cited defaults). KV capacity is the run's logged block count when it has one, otherwise
the roofline's (its `gpu_memory_utilization` set to the run's).

Errors are relative, per request, |predicted / measured - 1|, of end-to-end latency (last token -
queued) and time to first token (first token - queued), summarized by median and p90; and the run's
makespan (last token of the last request - first arrival) over the whole run.

Fit: Nelder-Mead over the coefficients' logarithms (positivity for free; efficiencies above 1, beyond
the data sheet, are refused), minimizing the mean over fitted requests of |log(pred/meas)| for
end-to-end latency plus the same for TTFT, plus |log| of the fitted part's own makespan ratio (its
last token minus the first arrival). Deterministic: it starts from the defaults with a fixed simplex.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from gyre.roofline import Coefficients
from gyre.roofline_comm import ep_group_step_time
from gyre.sim.vllm_check.vllm_scheduler import ReplayResult, replay
from gyre.sim.vllm_check.serving_run import Requests, Run, RunError, read_json, setup
from gyre.sim.vllm_check.sim_replay import sim_engine_replay, sim_errors

ENGINE_FORMAT = 1
METRICS = ("e2e_median_rel_err", "e2e_p90_rel_err", "ttft_median_rel_err", "makespan_rel_err")


FITTED = ("eff_bw", "eff_kv", "eff_flops", "step_overhead_s")
FITTED_TP = FITTED + ("allreduce_s",)  # a tensor- or expert-parallel run also fits the collectives' latency
APPLIED = FITTED_TP  # what engine.json carries and --engine applies


def simulate(run: Run, coef: Coefficients) -> ReplayResult:
    roof, args = setup(run, coef)
    r = run.requests
    group = partial(ep_group_step_time, roof) if roof.expert_parallel else None
    try:
        return replay(r.queued, r.input_toks, r.output_toks, args, roof.step_time, run.engine.data_parallel, group)
    except ValueError as exc:
        raise RunError(f"{run.path / 'requests.jsonl'}: {exc}") from None


def errors(req: Requests, res: ReplayResult, idx: np.ndarray) -> dict[str, float]:
    """The report's four errors for requests `idx` (makespan: over the whole run)."""
    e2e = np.abs((res.last_token[idx] - req.queued[idx]) / req.e2e[idx] - 1.0)
    ttft = np.abs((res.first_token[idx] - req.queued[idx]) / np.maximum(req.ttft[idx], 1e-9) - 1.0)
    mk = float(res.last_token.max() - req.queued.min())
    return {"e2e_median_rel_err": float(np.median(e2e)), "e2e_p90_rel_err": float(np.quantile(e2e, 0.9)),
            "ttft_median_rel_err": float(np.median(ttft)), "makespan_rel_err": abs(mk / req.makespan - 1.0)}


def _loss(req: Requests, res: ReplayResult, idx: np.ndarray) -> float:
    e2e = np.log((res.last_token[idx] - req.queued[idx]) / req.e2e[idx])
    ttft = np.log(np.maximum(res.first_token[idx] - req.queued[idx], 1e-3) / np.maximum(req.ttft[idx], 1e-3))
    span = (res.last_token[idx].max() - req.queued[0]) / (req.last_token[idx].max() - req.queued[0])
    return float(np.mean(np.abs(e2e)) + np.mean(np.abs(ttft)) + abs(math.log(span)))


@dataclass(frozen=True, kw_only=True)
class Fit:
    coef: Coefficients
    names: tuple[str, ...]
    loss: float
    evaluations: int


def fit(run: Run, idx: np.ndarray, start: Coefficients = Coefficients(), max_evals: int = 240) -> Fit:
    """Coefficients minimizing the loss on requests `idx` (see the module docstring)."""
    e = run.engine
    names = FITTED_TP if e.tensor_parallel > 1 or (e.expert_parallel and e.data_parallel > 1) else FITTED

    def coef_of(x: np.ndarray) -> Coefficients:
        return replace(start, **{k: math.exp(v) for k, v in zip(names, x)})

    def f(x: np.ndarray) -> float:
        c = coef_of(x)
        if c.eff_bw > 1.0 or c.eff_kv > 1.0 or c.eff_flops > 1.0:  # beyond the data sheet: not physical
            return 1e3 + float(np.sum(np.abs(x)))
        return _loss(run.requests, simulate(run, c), idx)

    x0 = np.log([max(getattr(start, k), 1e-6) for k in names])
    simplex = np.vstack([x0] + [x0 - 0.4 * np.eye(len(x0))[i] for i in range(len(x0))])
    r = optimize.minimize(f, x0, method="Nelder-Mead",
                          options={"initial_simplex": simplex, "maxfev": max_evals, "xatol": 1e-3, "fatol": 1e-4})
    return Fit(coef=coef_of(r.x), names=names, loss=float(r.fun), evaluations=int(r.nfev))


def coef_dict(c: Coefficients) -> dict[str, float]:
    return {k: float(getattr(c, k)) for k in APPLIED}


def engine_json(coef: Coefficients, run: Run, fitted: tuple[str, ...], report: dict[str, Any],
                applied: bool = False) -> dict[str, Any]:
    """engine.json: the coefficients, which were fitted, and the run they were fitted on (or applied to)."""
    return {"gyre_engine": ENGINE_FORMAT, "coeffs": coef_dict(coef), "fitted": list(fitted),
            "applied_to" if applied else "fitted_on": {
                "run": str(run.path), "model": run.model, "model_preset": run.model_cfg.name, "gpu": run.gpu,
                "gpu_preset": run.gpu_cfg.name,
                "tensor_parallel": run.engine.tensor_parallel, "requests": len(run.requests)},
            "report": report}


def load_engine(path: Path, base: Coefficients = Coefficients()) -> Coefficients:
    """`base` with the coefficients of an engine.json (gyre-sim calibrate-engine -o); RunError if bad."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("gyre_engine") != ENGINE_FORMAT or not isinstance(doc.get("coeffs"), dict):
        raise RunError(f"{path}: not an engine calibration (expected 'gyre_engine': {ENGINE_FORMAT} and 'coeffs')")
    raw = doc["coeffs"]
    unknown = sorted(set(raw) - set(APPLIED))
    if unknown:
        raise RunError(f"{path}: unknown field coeffs.{unknown[0]} (known: {', '.join(APPLIED)})")
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise RunError(f"{path}: field coeffs.{k} must be a number >= 0, got {v!r}")
        if k.startswith("eff_") and not 0 < v <= 1:
            raise RunError(f"{path}: field coeffs.{k} must be in (0, 1], got {v!r}")
    return replace(base, **{k: float(v) for k, v in raw.items()})


def fit_report(run: Run, split: float | None, engine: Coefficients | None = None) -> dict[str, Any]:
    """The report: with `engine`, its errors on the whole run under `calibrated`; otherwise a fit on the
    first `split` by arrival and errors on the rest. `uncalibrated` is always the defaults; `simulator`
    is the simulator's own engine (gyre.sim.cluster.engine, sim_replay) with the calibrated coefficients."""
    from gyre.sim.vllm_check.serving_run import split_by_arrival

    n = len(run.requests)
    if engine is not None:
        test = np.arange(n)
        coef, info = engine, {"applied": True, "fitted": ()}
    else:
        train, test = split_by_arrival(n, split if split is not None else 0.7)
        ft = fit(run, train)
        coef = ft.coef
        info = {"fit_requests": len(train), "fit_loss": ft.loss, "fit_evaluations": ft.evaluations, "fitted": ft.names}
    cal = simulate(run, coef)
    unc = simulate(run, Coefficients())
    start, finish, _ = sim_engine_replay(run, coef)
    return {"calibrated": errors(run.requests, cal, test), "uncalibrated": errors(run.requests, unc, test),
            "simulator": sim_errors(run, finish, test), "coef": coef, "test_requests": len(test), **info,
            "_results": {"calibrated": cal, "uncalibrated": unc}, "_simulator": (start, finish), "_test": test}
