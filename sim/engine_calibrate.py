"""Fit and check the engine step cost against a real vLLM run: errors, fit, engine.json.

The replay (engine_replay) runs every request of the run; the coefficients (engine_model.StepCoeffs:
bandwidth and compute efficiency, fixed step overhead) are fitted to the first `split` of requests
by arrival and judged on the rest, next to the uncalibrated model (specs only, the coefficients'
defaults). Errors are relative, per request, |predicted / measured - 1|, of end-to-end latency
(last token - queued) and time to first token (first token - queued), summarized by median and p90;
and the run's makespan (last token of the last request - first arrival) over the whole run.

Fit: Nelder-Mead over the coefficients' logarithms (positivity for free), minimizing the mean over
fitted requests of |log(pred/meas)| for end-to-end latency plus the same for TTFT, plus |log| of the
fitted part's own makespan ratio (its last token minus the first arrival). Deterministic: a fixed
start (the defaults) and fixed simplex.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from gyre.sim.engine_model import FITTED, StepCoeffs, StepCost, UnknownPreset, gpu_preset, model_preset
from gyre.sim.engine_replay import ReplayResult, SchedulerArgs, replay
from gyre.sim.engine_run import Requests, Run, RunError

ENGINE_FORMAT = 1
METRICS = ("e2e_median_rel_err", "e2e_p90_rel_err", "ttft_median_rel_err", "makespan_rel_err")


def setup(run: Run, coeffs: StepCoeffs) -> tuple[StepCost, SchedulerArgs]:
    """The step cost and scheduler arguments of the run's own GPU, model and engine arguments."""
    try:
        model, gpu = model_preset(run.model), gpu_preset(run.gpu)
    except UnknownPreset as exc:
        raise RunError(f"{run.path / 'meta.json'}: {exc}") from None
    e = run.engine
    cost = StepCost(model=model, gpu=gpu, tp=e.tensor_parallel, coeffs=coeffs)
    blocks = e.kv_blocks if e.kv_blocks is not None else cost.kv_tokens_capacity(e.gpu_memory_utilization) // e.block_size
    if blocks <= 0:
        raise RunError(f"{run.path / 'meta.json'}: {model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) "
                       f"leaves no KV memory on {e.tensor_parallel} x {gpu.name}")
    args = SchedulerArgs(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                         block_size=e.block_size, kv_blocks=blocks)
    return cost, args


def simulate(run: Run, coeffs: StepCoeffs) -> ReplayResult:
    cost, args = setup(run, coeffs)
    r = run.requests
    try:
        return replay(r.queued, r.input_toks, r.output_toks, args, cost.time, run.engine.data_parallel)
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
    coeffs: StepCoeffs
    loss: float
    evaluations: int


def fit(run: Run, idx: np.ndarray, start: StepCoeffs = StepCoeffs(), max_evals: int = 200) -> Fit:
    """Coefficients minimizing the loss on requests `idx` (see the module docstring)."""
    base = start.to_dict()
    floor = {"overhead_s": 1e-4}  # log-parameterized: start a zero overhead at 0.1 ms

    def coeffs_of(x: np.ndarray) -> StepCoeffs:
        return replace(start, **{k: math.exp(v) for k, v in zip(FITTED, x)})

    def f(x: np.ndarray) -> float:
        c = coeffs_of(x)
        if c.eff_bw > 1.0 or c.eff_flops > 1.0 or c.overhead_s > 1.0:  # beyond the data sheet: not physical
            return 1e3
        return _loss(run.requests, simulate(run, c), idx)

    x0 = np.log([max(base[k], floor.get(k, 0.0)) for k in FITTED])
    simplex = np.vstack([x0] + [x0 + np.eye(len(x0))[i] * (-0.5 if FITTED[i] != "overhead_s" else 3.0)
                                for i in range(len(x0))])
    r = optimize.minimize(f, x0, method="Nelder-Mead",
                          options={"initial_simplex": simplex, "maxfev": max_evals, "xatol": 1e-3, "fatol": 1e-4})
    return Fit(coeffs=coeffs_of(r.x), loss=float(r.fun), evaluations=int(r.nfev))


def engine_json(coeffs: StepCoeffs, run: Run, report: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"gyre_engine": ENGINE_FORMAT, "coeffs": coeffs.to_dict(),
            "fitted_on": {"run": str(run.path), "model": run.model, "gpu": run.gpu,
                          "tensor_parallel": run.engine.tensor_parallel, "requests": len(run.requests)},
            "report": report or {}}


def load_engine(path: Path) -> StepCoeffs:
    """The coefficients of an engine.json (gyre-sim calibrate-engine -o); RunError on a bad file."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RunError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(doc, dict) or doc.get("gyre_engine") != ENGINE_FORMAT or not isinstance(doc.get("coeffs"), dict):
        raise RunError(f"{path}: not an engine calibration (expected 'gyre_engine': {ENGINE_FORMAT} and 'coeffs')")
    raw = doc["coeffs"]
    for k in FITTED:
        v = raw.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise RunError(f"{path}: field coeffs.{k} must be a number >= 0, got {v!r}")
    unknown = sorted(set(raw) - set(FITTED))
    if unknown:
        raise RunError(f"{path}: unknown field coeffs.{unknown[0]} (known: {', '.join(FITTED)})")
    c = StepCoeffs(**{k: float(raw[k]) for k in FITTED})
    if c.eff_bw <= 0 or c.eff_flops <= 0:
        raise RunError(f"{path}: field coeffs.eff_bw and coeffs.eff_flops must be > 0")
    return c


def calibrate_run(run: Run, split: float | None, engine: StepCoeffs | None = None) -> dict[str, Any]:
    """The report: with `engine`, its errors on the whole run under `calibrated`; otherwise a fit on the
    first `split` by arrival and errors on the rest. `uncalibrated` is always the defaults."""
    from gyre.sim.engine_run import split_by_arrival

    n = len(run.requests)
    if engine is not None:
        test = np.arange(n)
        coeffs, info = engine, {"applied": True}
    else:
        train, test = split_by_arrival(n, split if split is not None else 0.7)
        ft = fit(run, train)
        coeffs, info = ft.coeffs, {"fit_requests": len(train), "fit_loss": ft.loss, "fit_evaluations": ft.evaluations}
    cal = simulate(run, coeffs)
    unc = simulate(run, StepCoeffs())
    return {"calibrated": errors(run.requests, cal, test), "uncalibrated": errors(run.requests, unc, test),
            "coeffs": coeffs.to_dict(), "test_requests": len(test), **info,
            "_results": {"calibrated": cal, "uncalibrated": unc}, "_test": test}
