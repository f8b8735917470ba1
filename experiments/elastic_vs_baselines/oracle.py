"""How much of the gap to the staleness-aware lower bound is the price of not knowing rollout lengths?

The bound's staleness term (gyre.policies.bound) lets the longest groups share training steps. A policy
cannot choose that: it admits groups in the order the source hands them out and learns a rollout's length
only when it ends. This experiment hands the *same* groups to the same policies in two orders:
- "drawn": the workload's order (what every other experiment uses);
- "oracle": the groups a run trains (steps x groups_per_step), sorted by solo duration, longest first (the
  order the bound assumes; the groups a policy draws beyond them follow in drawn order).
The bound is the same for both (same groups). If a policy lands near the bound in oracle order, the policy
wastes little and what separates it from the bound in drawn order is foresight, which no online policy has.

Outputs: results/{preset}_oracle.csv (policy, order, makespan, bound, makespan / bound).

Usage: python experiments/elastic_vs_baselines/oracle.py [--preset xlong-swe] [--steps 48] [--eta 4]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.config import override
from gyre.policies.bound import group_solo_s
from gyre.presets import get_preset
from gyre.sim.runner import simulate
from gyre.workload import ReplaySource, WorkloadSource

HERE = Path(__file__).resolve().parent


def renumbered(groups, gps: int):
    """The groups in their new order, ids and intended steps renumbered to match the new order."""
    out = []
    for i, g in enumerate(groups):
        execs = [dataclasses.replace(e, group_id=i, step=i // gps) for e in g.executions]
        out.append(dataclasses.replace(g, group_id=i, step=i // gps, executions=execs))
    return out


def orders(cfg, extra_steps: int) -> dict[str, list]:
    """{order name: groups}: the drawn order and the oracle order of the same groups."""
    gps = cfg.workload.groups_per_step
    src = WorkloadSource(cfg.workload, cfg.seed)
    drawn = [src.next_group() for _ in range((cfg.steps + extra_steps) * gps)]
    trained = drawn[: cfg.steps * gps]
    solo = group_solo_s(trained, cfg.costs())
    oracle = [trained[i] for i in np.argsort(-solo, kind="stable")] + drawn[cfg.steps * gps:]
    return {"drawn": drawn, "oracle": renumbered(oracle, gps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="xlong-swe")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--async-rollout-gpus", type=int, default=512, help="async's split (the tuned one)")
    args = ap.parse_args()
    cfg = override(get_preset(args.preset), steps=args.steps)
    runs = [("async", {"rollout_gpus": args.async_rollout_gpus, "eta": args.eta}), ("elastic", {"eta": args.eta})]
    rows = []
    for order, groups in orders(cfg, extra_steps=args.eta + 2).items():
        for policy, params in runs:
            r = simulate(cfg, policy, params, source=ReplaySource(groups, cfg.workload))
            rows.append({"preset": args.preset, "policy": policy, "params": repr(params), "order": order,
                         "makespan_s": r.makespan_s, "bound_s": r.bound.makespan_s,
                         "bound_staleness_s": r.bound.staleness_s,
                         "over_bound": r.makespan_s / r.bound.makespan_s, "wall_s": r.wall_s})
            print(f"{policy:8s} {order:7s} makespan {r.makespan_s:9.0f} s ({r.makespan_s / 3600:.2f} h)  bound "
                  f"{r.bound.makespan_s:9.0f} s  x{r.makespan_s / r.bound.makespan_s:.2f}  (simulated in {r.wall_s:.0f} s)",
                  flush=True)
    df = pd.DataFrame(rows)
    out = HERE / "results" / f"{args.preset}_oracle.csv"
    df.to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
