"""Can one set of hardware-independent efficiencies predict both shared vLLM runs within 25%?

For each run in shared/data/vllm_timings (LLMServingSim's vLLM 0.19 validation runs, MIT licence) the
step-by-step replay (gyre.sim.vllm_check.engine_fit.simulate) runs with every efficiency (eff_bw, eff_kv,
eff_flops) set to one common value x, the other coefficients at their cited defaults, and with the
cited defaults themselves and with the data sheets alone (efficiencies 1, no overheads). It reports
the held-out (last 30% by arrival) median end-to-end error and its sign (median predicted / measured
- 1). If no x brings both runs within 25%, no hardware-independent efficiency can, whatever its source.

    python experiments/engine_calibration/run.py [--grid 0.3,0.4,...]   ->  results/uniform.csv, uniform.png
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace
from pathlib import Path

import numpy as np

from gyre.roofline import Coefficients
from gyre.sim.vllm_check.engine_fit import errors, simulate
from gyre.sim.vllm_check.serving_run import read_run, split_by_arrival

DATA = Path("/work/shared/data/vllm_timings")
OUT = Path(__file__).resolve().parent / "results"
SHEETS = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=0.0, eff_link=1.0)


def row(run, name: str, label: str, coef: Coefficients, test: np.ndarray) -> dict:
    r = run.requests
    res = simulate(run, coef)
    e = errors(r, res, test)
    signed = float(np.median((res.last_token[test] - r.queued[test]) / r.e2e[test] - 1.0))
    return {"run": name, "coefficients": label, "e2e_median_rel_err": round(e["e2e_median_rel_err"], 4),
            "e2e_median_signed": round(signed, 4), "makespan_rel_err": round(e["makespan_rel_err"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    grid = [float(x) for x in a.grid.split(",")]
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for d in sorted(p for p in DATA.iterdir() if (p / "meta.json").exists()):
        run = read_run(d)
        _, test = split_by_arrival(len(run.requests), 0.7)
        rows.append(row(run, d.name, "defaults", Coefficients(), test))
        rows.append(row(run, d.name, "data sheets", SHEETS, test))
        for x in grid:
            rows.append(row(run, d.name, f"x={x}", replace(Coefficients(), eff_bw=x, eff_kv=x, eff_flops=x), test))
            print(rows[-1], flush=True)
    with (out / "uniform.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["run"] for r in rows):
        pts = [(float(r["coefficients"][2:]), r["e2e_median_signed"]) for r in rows
               if r["run"] == name and r["coefficients"].startswith("x=")]
        ax.plot(*zip(*pts), "o-", label=name)
    ax.axhspan(-0.25, 0.25, color="g", alpha=0.12, label="within 25%")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("common efficiency x (eff_bw = eff_kv = eff_flops)")
    ax.set_ylabel("held-out median e2e: predicted / measured - 1")
    ax.set_title("one efficiency for both runs (data: LLMServingSim, MIT)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "uniform.png", dpi=110)
    print(f"wrote {out / 'uniform.csv'}, {out / 'uniform.png'}")


if __name__ == "__main__":
    main()
