"""`--recent all` against `--recent auto` on every public trace in shared/data, held-out fit quality side by side.

Run: .venv/bin/python experiments/trace_calibration/run.py  (writes results/recent_default.csv; ~2 min)
The default of `gyre-sim calibrate --recent` is the mode that meets more (trace, quantity, target) marks here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from gyre.traces.formats import load_trace
from gyre.traces.readers import Grouping
from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload

DATA = Path("/work/shared/data")
TRACES = [DATA / "azure_llm_inference_2023_code.csv", DATA / "vllm_timings/RTX4090_Llama-3.1-8B/requests.jsonl",
          DATA / "vllm_timings/RTXPRO6000_Qwen3-32B/requests.jsonl", DATA / "agent_trajectories"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=len(TRACES), help="the first N traces only")
    ap.add_argument("--draws", type=int, default=100_000, help="model draws per fit")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    a = ap.parse_args()
    rows = []
    for path in TRACES[: a.traces]:
        tr = load_trace(path, grouping=Grouping(group_size=8, groups_per_step=64))
        for mode in ("all", "auto"):
            cw = fit_workload(tr, WorkloadFitOptions(split=0.7, recent=mode, model_draws=a.draws))
            for q, m in cw.report.get("quality", {}).items():
                rows.append({"trace": path.name if path.name != "requests.jsonl" else path.parent.name, "mode": mode,
                             "chosen": cw.report["recent"]["chosen"], "quantity": q, "n_held": int(m["n_test"]),
                             "ks_d": m["ks_d"], "p99_err": m["p99_err"], "maxk_mean_err": m["maxk_mean_err"],
                             "marks_met": sum(m["marks"].values())})
    df = pd.DataFrame(rows)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "recent_default.csv", index=False)
    pd.set_option("display.width", 160)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(df.groupby("mode")[["marks_met", "ks_d", "p99_err", "maxk_mean_err"]].agg(
        {"marks_met": "sum", "ks_d": "mean", "p99_err": "mean", "maxk_mean_err": "mean"}))


if __name__ == "__main__":
    main()
