"""The 48-step equal-work tables from run48.py's rows: per file (a preset, cluster and seed), each configuration's
latest row, whether it does equal work, and elastic / best async, elastic / colocate and elastic / the faster of
the two (the best baseline) at equal work.

Equal work is compare's rule (policies.tuning.equal_work): a row's scheduler-induced cuts exceed the least of
the file's rows by at most 1% of the run's executions. Only the per-engine caps of `--caps` are read (the
grid run48.py was run over; a file may hold older rows at other caps). Prints a markdown table per file and
the headline over files, and writes <results>/run48_summary.csv.

Usage: python experiments/elastic_vs_baselines/table48.py [--caps 4,5] [--steps 48] [--results DIR]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from gyre.policies.tuning import equal_work
from gyre.presets import get_preset

from run48 import HERE

CONFIG = ["policy", "eta", "rollout_gpus", "max_running"]


def latest_rows(path, caps: set[int]) -> pd.DataFrame:
    """Each configuration's last row in `path` (rows are appended as they are rerun), at the caps given."""
    d = pd.read_csv(path)
    d = d[(d["policy"] == "colocate") | d["max_running"].isin(caps)]
    d = d.drop_duplicates(subset=CONFIG, keep="last").copy()
    d["equal_work"] = equal_work(d["sched_cuts"].astype(int).tolist(), int(d["executions"].max()))
    return d.reset_index(drop=True)


def headline(d: pd.DataFrame) -> dict:
    """The fastest equal-work row of each policy, and elastic's ratios against the other two."""
    ok = d[d["equal_work"]]
    best = {p: ok[ok["policy"] == p].nsmallest(1, "makespan_s") for p in ("colocate", "async", "elastic")}
    out = {}
    for p, r in best.items():
        out[f"{p}_h"] = float(r["makespan_s"].iloc[0]) / 3600 if len(r) else float("nan")
        out[f"{p}_config"] = (f"R = {int(r['rollout_gpus'].iloc[0])}, " if p == "async" and len(r) else "") + (
            f"cap {int(r['max_running'].iloc[0])}" if p != "colocate" and len(r) else "")
        out[f"{p}_sched_cuts"] = int(r["sched_cuts"].iloc[0]) if len(r) else -1
    out["elastic_vs_async"] = out["async_h"] / out["elastic_h"]
    out["elastic_vs_colocate"] = out["colocate_h"] / out["elastic_h"]
    out["elastic_vs_best"] = min(out["async_h"], out["colocate_h"]) / out["elastic_h"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="4,5", help="per-engine caps of the grid (comma-separated)")
    ap.add_argument("--steps", type=int, default=48, help="the run length of the row files read")
    ap.add_argument("--results", type=Path, default=HERE / "results", help="the folder of run48.py's row files")
    a = ap.parse_args()
    caps = {int(c) for c in a.caps.split(",")}
    rows = []
    for path in sorted(a.results.glob(f"run48_*_s{a.steps}_seed*.csv")):
        m = re.match(rf"run48_(.+?)(?:_g(\d+))?_s{a.steps}_seed(\d+)\.csv", path.name)
        d = latest_rows(path, caps)
        gpus = int(m.group(2)) if m.group(2) else int(get_preset(m.group(1)).cluster.gpus)
        h = {"preset": m.group(1), "gpus": gpus, "seed": int(m.group(3)), "rows": len(d),
             "least_cuts": int(d["sched_cuts"].min()), "executions": int(d["executions"].max()), **headline(d)}
        rows.append(h)
        print(f"\n### {path.name}: {len(d)} rows, equal work = sched cuts <= {h['least_cuts']} + "
              f"{0.01 * h['executions']:.0f}\n")
        print("| policy | R | cap | makespan | deadline cuts | sched cuts | equal work | tokens | preempt | migrations |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for _, r in d.sort_values(["policy", "rollout_gpus", "max_running"]).iterrows():
            R = "" if pd.isna(r["rollout_gpus"]) else int(r["rollout_gpus"])
            cap = "" if pd.isna(r["max_running"]) else int(r["max_running"])
            print(f"| {r['policy']} | {R} | {cap} | {r['makespan_s'] / 3600:.2f} h | {r['deadline_cuts']} | {r['sched_cuts']} | "
                  f"{'yes' if r['equal_work'] else 'no'} | {r['tokens_generated'] / 1e6:,.1f}M | {r['preemptions']} | {r['migrations']} |")
        print(f"\nelastic / best async {h['elastic_vs_async']:.3f}x ({h['elastic_h']:.2f} h {h['elastic_config']} vs "
              f"{h['async_h']:.2f} h {h['async_config']}), elastic / colocate {h['elastic_vs_colocate']:.3f}x, "
              f"elastic / the best equal-work baseline {h['elastic_vs_best']:.3f}x")
    out = pd.DataFrame(rows)
    out.to_csv(a.results / "run48_summary.csv", index=False)
    print("\n" + out[["preset", "gpus", "seed", "elastic_vs_async", "elastic_vs_colocate", "elastic_vs_best", "elastic_config",
                      "async_config", "least_cuts"]].to_string(index=False))


if __name__ == "__main__":
    main()
