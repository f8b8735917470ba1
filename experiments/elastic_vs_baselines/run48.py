"""One equal-work row over a whole run (48 steps of xlong-swe-kv by default): a policy at one eta, per-engine cap
and (async) split.

Each row states its work: makespan, deadline cuts, scheduler-induced cuts (cut by the deadline though the
execution alone on an idle engine finishes within it: gyre.sim.harness.sched_cuts), tokens generated,
preemptions, migrations. The row is appended to <out>/run48_<preset>_s<steps>_seed<seed>.csv (with `--gpus N`,
the preset on N GPUs: run48_<preset>_g<N>_s<steps>_seed<seed>.csv), so each row of the README's table reruns
alone (minutes of CPU each); table48.py reads the files.

Usage: python experiments/elastic_vs_baselines/run48.py --policy elastic --eta 4 --cap 5
       python experiments/elastic_vs_baselines/run48.py --policy async --eta 4 --split 672 --cap 5
       python experiments/elastic_vs_baselines/run48.py --policy colocate --gpus 640
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.sim.harness.sched_cuts import scheduler_cuts

HERE = Path(__file__).resolve().parent


def run(cfg, policy: str, params: dict) -> dict:
    """One simulation of `policy` with `params` on `cfg`, as one row with its work columns."""
    t0 = time.perf_counter()
    r = simulate(cfg, policy, params)
    s = r.metrics.summary()
    gpus = r.metrics.steps["gpus"].astype(int).tolist()
    return {"policy": policy, "eta": params.get("eta", 0), "rollout_gpus": params.get("rollout_gpus"),
            "max_running": params.get("max_running"),
            "makespan_s": r.makespan_s, "deadline_cuts": int(s.get("deadline_hit", 0)),
            "sched_cuts": scheduler_cuts(r.log, r.groups, r.costs)["sched_cuts"],
            "tokens_generated": int(s.get("tokens_generated", 0)), "preemptions": int(s.get("preemptions", 0)),
            "migrations": int(s.get("migrations", 0)), "train_gpus": " ".join(map(str, gpus)),
            "executions": sum(len(g.executions) for g in r.groups[: cfg.steps * cfg.workload.groups_per_step]),
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=["colocate", "async", "elastic"], required=True)
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--cap", type=int, default=0, help="per-engine cap (max_running); 0: none")
    ap.add_argument("--split", type=int, default=0, help="async's rollout GPUs (required for async)")
    ap.add_argument("--gpus", type=int, default=0, help="the cluster's GPUs; 0: the preset's")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="the folder of the row files")
    a = ap.parse_args()
    if a.policy == "async" and a.split <= 0:
        ap.error("--split: async needs its rollout GPUs (> 0)")
    if a.gpus < 0:
        ap.error("--gpus: a positive GPU count, or 0 for the preset's")
    params = {} if a.policy == "colocate" else {"eta": a.eta}
    if a.policy == "async":
        params["rollout_gpus"] = a.split
    if a.cap:
        params["max_running"] = a.cap
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed, **({"cluster.gpus": a.gpus} if a.gpus else {}))
    cfg.validate()
    row = {"preset": a.preset, "steps": a.steps, "seed": a.seed, **({"gpus": a.gpus} if a.gpus else {}),
           **run(cfg, a.policy, params)}
    print(row, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"run48_{a.preset}{f'_g{a.gpus}' if a.gpus else ''}_s{a.steps}_seed{a.seed}.csv"
    pd.DataFrame([row]).to_csv(out, mode="a", header=not out.exists(), index=False)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
