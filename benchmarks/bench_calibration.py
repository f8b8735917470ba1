"""Benchmark: does a calibration hold on the part of a trace it has not seen?

Fits on the first 70% of a trace by time (`gyre-sim calibrate`'s default split) and judges the fit on
the rest, per quantity: KS D, p99 error, and the error of the median and of the mean of the maximum
of K draws (K = the batch size, at most the held-out count). Then draws `--draws` executions from the
calibrated workload and checks that no token count exceeds the context window. Targets (printed as
PASS/FAIL for the generated tokens, or turns for a multi-turn trace): KS D <= 0.10, p99 error <= 15%,
mean-of-max-of-K error <= 15%, no draw above the context window.

    .venv/bin/python benchmarks/bench_calibration.py [TRACE ...] [--format auto] [--drift auto]

Default trace: the shared Azure LLM inference 2023 code trace (Azure Public Dataset, CC-BY 4.0).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

AZURE = "/work/shared/data/azure_llm_inference_2023_code.csv"
TARGETS = {"ks_d": 0.10, "p99_err": 0.15, "maxk_mean_err": 0.15}


def check(path: str, fmt: str, drift: str, group_size: int, groups_per_step: int, draws: int) -> bool:
    from gyre.traces.formats import load_trace
    from gyre.traces.calibrate import CalibrateOptions, calibrate
    from gyre.traces.calibrated import sample_quantities
    from gyre.traces.readers import Grouping

    t0 = time.perf_counter()
    tr = load_trace(Path(path), fmt, grouping=Grouping(group_size=group_size, groups_per_step=groups_per_step))
    cw = calibrate(tr, CalibrateOptions(split=0.7, drift=drift))
    r = cw.report
    print(f"{path}: {r['executions']} executions, fitted {r['fitted']}, held out {r['held_out']}, K {r['k']}, "
          f"drift {r['drift']['chosen']} ({r['drift']['why']}), {time.perf_counter() - t0:.1f} s")
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
    ap.add_argument("traces", nargs="*", default=[AZURE])
    ap.add_argument("--format", default="auto")
    ap.add_argument("--drift", default="auto")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=64)
    ap.add_argument("--draws", type=int, default=1_000_000)
    a = ap.parse_args()
    results = [check(t, a.format, a.drift, a.group_size, a.groups_per_step, a.draws) for t in a.traces]
    print("all targets met" if all(results) else "some targets missed")


if __name__ == "__main__":
    main()
