"""Benchmark: does a calibration hold on the part of a trace it has not seen?

Fits on the first 70% of a trace by time (`gyre-sim calibrate`'s default split) and judges the fit on
the rest, per quantity: KS D, p99 error, and the error of the median and of the mean of the maximum
of K draws (K = the batch size, at most the held-out count). Then draws `--draws` executions from the
calibrated workload and checks that no token count exceeds the context window. Targets (printed as
PASS/FAIL for the generated tokens, or turns for a multi-turn trace): KS D <= 0.10, p99 error <= 15%,
mean-of-max-of-K error <= 15%, no draw above the context window.

Where the fit parts from the data, for the target quantity: the KS D of the model against the data it
was fitted on (a shape error: the model misdescribes what it saw), of the fitted data against the
held-out data (a change over time: what no stationary fit of all of it can beat), the KS D a perfect
model would show on that many held-out values (0.87 / sqrt(n), the Kolmogorov distribution's mean),
and the quantiles where the model's and the held-out CDFs part most.

    .venv/bin/python benchmarks/bench_calibration.py [TRACE ...] [--format auto] [--drift auto] [--recent auto]

Default traces: every one the project ships: the Azure LLM inference 2023 code trace (Azure Public
Dataset, CC-BY 4.0) and the request logs of the two vLLM runs in shared/data/vllm_timings (300 ShareGPT
conversations each; LLMServingSim, MIT).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

AZURE = "/work/shared/data/azure_llm_inference_2023_code.csv"
VLLM_LOGS = sorted(str(p) for p in Path("/work/shared/data/vllm_timings").glob("*/requests.jsonl"))
TARGETS = {"ks_d": 0.10, "p99_err": 0.15, "maxk_mean_err": 0.15}


def parting(model: np.ndarray, test: np.ndarray, top: int = 3) -> list[tuple[float, float, float]]:
    """(value, model CDF, held-out CDF) where the two CDFs differ most, largest gap first."""
    model, test = np.sort(model), np.sort(test)
    grid = np.unique(test)
    fm = np.searchsorted(model, grid, side="right") / len(model)
    ft = np.searchsorted(test, grid, side="right") / len(test)
    order = np.argsort(-np.abs(fm - ft), kind="stable")[:top]
    return [(float(grid[i]), float(fm[i]), float(ft[i])) for i in order]


def shape_check(tr, cw, key: str) -> None:
    """Where the fit of `key` parts from the data (module docstring)."""
    from gyre.traces.heldout import quantities, split_groups
    from gyre.traces.workload_fit import recent_groups
    from gyre.traces.calibrated import sample_quantities
    from gyre.traces.tail_dist import _ecdf_distances

    train, test = split_groups(tr.groups, 0.7)
    fitted = recent_groups(train, cw.report["recent"]["chosen"])
    a, b = quantities(fitted, cw.scale_target)["length"], quantities(test, cw.scale_target)["length"]
    model = sample_quantities(cw, np.zeros(max(1, 200_000 // cw.base.group_size)), seed=2)["length"]
    ks_in, ks_ab = _ecdf_distances(model, a)[0], _ecdf_distances(a, b)[0]
    print(f"  where {key} parts: KS D model vs its fitted data {ks_in:.4f} (shape), fitted vs held-out data "
          f"{ks_ab:.4f} (change over time), a perfect model on {len(b)} values ~{0.87 / np.sqrt(len(b)):.3f}")
    print("    largest CDF gaps (value: model / held out): " + ", ".join(
        f"{v:g}: {m:.3f} / {t:.3f}" for v, m, t in parting(model, b)))


def check(path: str, fmt: str, drift: str, recent: str, group_size: int, groups_per_step: int, draws: int) -> bool:
    from gyre.traces.formats import load_trace
    from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload
    from gyre.traces.calibrated import sample_quantities
    from gyre.traces.readers import Grouping

    t0 = time.perf_counter()
    tr = load_trace(Path(path), fmt, grouping=Grouping(group_size=group_size, groups_per_step=groups_per_step))
    cw = fit_workload(tr, WorkloadFitOptions(split=0.7, drift=drift, recent=recent))
    r = cw.report
    print(f"{path}: {r['executions']} executions, fitted {r['fitted']}, held out {r['held_out']}, K {r['k']}, "
          f"drift {r['drift']['chosen']} ({r['drift']['why']}), fitted window {r['recent']['chosen']:.0%} "
          f"({r['recent']['why']}), {time.perf_counter() - t0:.1f} s")
    for name, t in r["tails"].items():
        print(f"  tail {name}: {t}")
    print(f"  {'quantity':<9} {'n':>6} {'K':>5} {'KS D':>7} {'p50':>7} {'p99':>7} {'maxK med':>9} "
          f"{'maxK mean':>10}  mean max model/test")
    for name, m in r["quality"].items():
        print(f"  {name:<9} {m['n_test']:>6.0f} {m['k']:>5.0f} {m['ks_d']:>7.4f} {m['p50_err']:>7.1%} "
              f"{m['p99_err']:>7.1%} {m['maxk_err']:>9.1%} {m['maxk_mean_err']:>10.1%}  "
              f"{m['maxk_mean_model']:.4g}/{m['maxk_mean_test']:.4g}")
    steps = np.arange(max(1, draws // cw.base.group_size)) % 1000
    model = sample_quantities(cw, steps.astype(float), seed=1)
    window = cw.base.context_window
    worst = max(float(model[n].max()) for n in ("length", "gen", "prompt", "tool_out") if len(model[n]))
    key = cw.scale_target
    shape_check(tr, cw, key)
    q = r["quality"][key]
    ok = True
    for metric, limit in TARGETS.items():
        good = q[metric] <= limit
        ok &= good
        print(f"  {'PASS' if good else 'FAIL'} {key} {metric} {q[metric]:.4f} (target <= {limit})")
    good = worst <= window
    ok &= good
    print(f"  {'PASS' if good else 'FAIL'} largest token count in {len(steps) * cw.base.group_size} drawn "
          f"executions {worst:.0f} (context window {window})")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*", default=[AZURE, *VLLM_LOGS])
    ap.add_argument("--format", default="auto")
    ap.add_argument("--drift", default="auto")
    ap.add_argument("--recent", default="auto")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=64)
    ap.add_argument("--draws", type=int, default=1_000_000)
    a = ap.parse_args()
    results = [check(t, a.format, a.drift, a.recent, a.group_size, a.groups_per_step, a.draws) for t in a.traces]
    print("all targets met" if all(results) else "some targets missed")


if __name__ == "__main__":
    main()
