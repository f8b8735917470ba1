"""The model-based elastic against async at its best split for the same eta, and colocate, at equal work.

For each eta: elastic, and async at every split R given; colocate once (eta 0). Each row states its work:
deadline cuts, scheduler-induced cuts (cut by the deadline though the execution alone on an idle engine
finishes within it: the bound's solo latency says which), tokens generated, preemptions. Equal work: a
run whose scheduler-induced cuts exceed the least of its eta's runs by more than 1% of the run's
executions is marked and never the best split; the table gives colocate's cuts beside them. Prints a markdown table and writes
results/model_based_<preset>_s<steps>_seed<seed>.csv.

Elastic runs at each per-engine cap of `--caps` (`max_running`; 'all': as compare's search) and its
row at each eta is the fastest within 1% of the executions of its least-cutting run there.

Usage: python experiments/elastic_vs_baselines/model_based.py --preset xlong-swe-kv --steps 6 --etas 4
       --splits 256,384,512,640 [--caps all]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.sim.harness.sched_cuts import scheduler_cuts as work_cuts
from gyre.presets import get_preset
from gyre.policies.tuning import halvings
from gyre.sim.harness.compare import shape_of
from gyre.sim.harness.runner import simulate

HERE = Path(__file__).resolve().parent


def scheduler_cuts(r) -> int:
    """Executions cut by their deadline whose solo latency (sim/cluster/bound.py) is within it."""
    return work_cuts(r.log, r.groups, r.costs)["sched_cuts"]


def run(cfg, policy: str, params: dict) -> dict:
    t0 = time.perf_counter()
    r = simulate(cfg, policy, params)
    s = r.metrics.summary()
    gpus = r.metrics.steps["gpus"].astype(int).tolist()
    return {"policy": policy, "eta": params.get("eta", 0), "rollout_gpus": params.get("rollout_gpus"),
            "max_running": params.get("max_running"),
            **({"tiers": " ".join(f"{a:g}:{n}" for a, n in params["tiers"])} if params.get("tiers") else {}),
            "makespan_s": r.makespan_s, "deadline_cuts": int(s.get("deadline_hit", 0)), "sched_cuts": scheduler_cuts(r),
            "tokens_generated": int(s.get("tokens_generated", 0)), "preemptions": int(s.get("preemptions", 0)),
            "migrations": int(s.get("migrations", 0)), "train_gpus": " ".join(map(str, gpus)),
            "executions": sum(len(g.executions) for g in r.groups[: cfg.steps * cfg.workload.groups_per_step]),
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--etas", default="4")
    ap.add_argument("--splits", default="", help="async rollout GPUs to try (default: every engine multiple)")
    ap.add_argument("--caps", default="",
                    help="elastic's per-engine caps to try (max_running; 0: none; 'all': none and the admission "
                         "limit's halvings, as compare's search): its row at each eta is the fastest of them within "
                         "1%% of the executions of the least-cutting (default: none only)")
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    costs = cfg.costs()
    per, n, need = costs.engine_gpus, cfg.cluster.gpus, costs.min_train_gpus
    splits = [int(x) for x in a.splits.split(",")] if a.splits else list(range(per, n - need + 1, per))
    limit = shape_of(cfg).admit_limit
    caps = ([0] + halvings(limit)[1:] if a.caps == "all" else [int(x) for x in a.caps.split(",")] if a.caps else [0])
    rows = [run(cfg, "colocate", {})]
    print(rows[-1], flush=True)
    for eta in (int(x) for x in a.etas.split(",")):
        for cap in caps:
            p = {"eta": eta, **({"max_running": cap} if cap else {})}
            rows.append(run(cfg, "elastic", p))
            print(rows[-1], flush=True)
        for r in splits:
            rows.append(run(cfg, "async", {"eta": eta, "rollout_gpus": r}))
            print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    tol = 0.01 * df["executions"].iloc[0]
    lines = [f"{a.preset}, {a.steps} steps, seed {a.seed} ({n} GPUs, engines of {per}, trainer >= {need}; "
             f"ceiling N / (N - trainer minimum) = {n / (n - need):.2f}x)", "",
             "| eta | elastic (h) | best equal-work async (R) | elastic / async | colocate (h) | elastic / colocate | "
             "sched cuts: elastic / async / colocate | tokens: elastic / colocate |", "|---|---|---|---|---|---|---|---|"]
    col = df[df.policy == "colocate"].iloc[0]
    for eta, grp in df[df.policy != "colocate"].groupby("eta"):
        least = grp["sched_cuts"].min()
        df.loc[grp.index, "equal_work"] = grp["sched_cuts"] <= least + tol
        els = grp[grp.policy == "elastic"]  # its fastest cap within 1% of its least-cutting one (compare's search)
        els = els[els["sched_cuts"] <= els["sched_cuts"].min() + tol]
        el = els.loc[els["makespan_s"].idxmin()]
        asy = grp[(grp.policy == "async") & (grp["sched_cuts"] <= least + tol)]
        best = asy.loc[asy["makespan_s"].idxmin()] if len(asy) else None
        b = f"{best['makespan_s'] / 3600:.2f} (R = {int(best['rollout_gpus'])})" if best is not None else "none"
        ratio = f"{best['makespan_s'] / el['makespan_s']:.3f}x" if best is not None else "-"
        cap = "" if pd.isna(el["max_running"]) else f" (cap {int(el['max_running'])})"
        lines.append(f"| {eta} | {el['makespan_s'] / 3600:.2f}{cap} | {b} | {ratio} | {col['makespan_s'] / 3600:.2f} | "
                     f"{col['makespan_s'] / el['makespan_s']:.3f}x | {el['sched_cuts']} / "
                     f"{best['sched_cuts'] if best is not None else '-'} / {col['sched_cuts']} | "
                     f"{el['tokens_generated'] / 1e6:.1f}M / {col['tokens_generated'] / 1e6:.1f}M |")
    out = HERE / "results" / f"model_based_{a.preset}_s{a.steps}_seed{a.seed}{'_caps' if a.caps else ''}.csv"
    df.to_csv(out, index=False)
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
