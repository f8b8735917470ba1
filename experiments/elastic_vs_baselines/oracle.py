"""How much of the gap to the staleness-aware lower bound is the price of not knowing rollout lengths?

The bound's staleness term (gyre.sim.cluster.bound) lets the longest groups share training steps. A policy
cannot choose that: it admits groups in the order the source hands them out and learns a rollout's length
only when it ends. This experiment hands the *same* groups to the same policies in two orders:
- "drawn": the workload's order (what every other experiment uses);
- "oracle": the groups a run trains (steps x groups_per_step), sorted by solo duration, longest first (the
  order the bound assumes; the groups a policy draws beyond them follow in drawn order).
The bound is the same for both (same groups). If a policy lands near the bound in oracle order, the policy
wastes little and what separates it from the bound in drawn order is foresight, which no online policy has.

With `--horizons 2,4,8,16`, elastic also runs with partial foresight: the groups sorted longest first within
consecutive windows of h steps, as if each group's length were known h steps ahead.

Outputs: results/{preset}_oracle.csv (policy, order, makespan, bound, makespan / bound); with --horizons,
results/{preset}_foresight.csv and .png (elastic's makespan / bound against the horizon).

Usage: python experiments/elastic_vs_baselines/oracle.py [--preset xlong-swe] [--steps 48] [--eta 4] [--horizons 2,4,8,16]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.config import override
from gyre.sim.cluster.bound import group_solo_s
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.workload import ReplaySource, WorkloadSource

HERE = Path(__file__).resolve().parent


def renumbered(groups, gps: int):
    """The groups in their new order, ids and intended steps renumbered to match the new order."""
    out = []
    for i, g in enumerate(groups):
        execs = [dataclasses.replace(e, group_id=i, step=i // gps) for e in g.executions]
        out.append(dataclasses.replace(g, group_id=i, step=i // gps, executions=execs))
    return out


def orders(cfg, extra_steps: int, horizons: tuple[int, ...] = ()) -> dict[str, list]:
    """{order name: groups}: the drawn order, the oracle order of the same groups, and for each horizon h the
    groups sorted longest first within consecutive windows of h steps (foresight of h steps' lengths)."""
    gps = cfg.workload.groups_per_step
    src = WorkloadSource(cfg.workload, cfg.seed)
    drawn = [src.next_group() for _ in range((cfg.steps + extra_steps) * gps)]
    n = cfg.steps * gps
    solo = group_solo_s(drawn[:n], cfg.costs())

    def sorted_within(width: int) -> list:
        idx = [i for a in range(0, n, width) for i in a + np.argsort(-solo[a:a + width], kind="stable")]
        return renumbered([drawn[i] for i in idx] + drawn[n:], gps)

    out = {"drawn": drawn, "oracle": sorted_within(n)}
    out.update({f"horizon {h}": sorted_within(h * gps) for h in horizons})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="xlong-swe")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--async-rollout-gpus", type=int, default=512, help="async's split (the tuned one)")
    ap.add_argument("--horizons", default="", help="comma-separated foresight horizons in steps (elastic only), "
                                                   "e.g. 2,4,8,16: written to {preset}_foresight.csv/.png")
    args = ap.parse_args()
    cfg = override(get_preset(args.preset), steps=args.steps)
    runs = [("async", {"rollout_gpus": args.async_rollout_gpus, "eta": args.eta}), ("elastic", {"eta": args.eta})]
    horizons = tuple(int(h) for h in args.horizons.split(",") if h)
    rows = []
    for order, groups in orders(cfg, extra_steps=args.eta + 2, horizons=horizons).items():
        for policy, params in runs:
            if order.startswith("horizon") and policy != "elastic":
                continue
            r = simulate(cfg, policy, params, source=ReplaySource(groups, cfg.workload))
            rows.append({"preset": args.preset, "policy": policy, "params": repr(params), "order": order,
                         "makespan_s": r.makespan_s, "bound_s": r.bound.makespan_s,
                         "bound_staleness_s": r.bound.staleness_s,
                         "over_bound": r.makespan_s / r.bound.makespan_s, "wall_s": r.wall_s})
            print(f"{policy:8s} {order:7s} makespan {r.makespan_s:9.0f} s ({r.makespan_s / 3600:.2f} h)  bound "
                  f"{r.bound.makespan_s:9.0f} s  x{r.makespan_s / r.bound.makespan_s:.2f}  (simulated in {r.wall_s:.0f} s)",
                  flush=True)
    df = pd.DataFrame(rows)
    if horizons:
        foresight(df, args.steps, HERE / "results" / f"{args.preset}_foresight")
        df = df[~df.order.str.startswith("horizon")]
    out = HERE / "results" / f"{args.preset}_oracle.csv"
    df.to_csv(out, index=False)
    print(f"wrote {out}")


def foresight(df: pd.DataFrame, steps: int, stem: Path) -> None:
    """Elastic's makespan / bound against how many steps ahead the rollout lengths are known (0: drawn order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = df[df.policy == "elastic"].copy()
    e["horizon_steps"] = e.order.map(lambda o: 0 if o == "drawn" else steps if o == "oracle" else int(o.split()[1]))
    e = e.sort_values("horizon_steps")
    e[["horizon_steps", "makespan_s", "bound_s", "over_bound"]].to_csv(stem.with_suffix(".csv"), index=False)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(e.horizon_steps.clip(lower=0.5), e.over_bound, "o-")
    ax.axhline(1.1, ls="--", c="grey", lw=0.8)
    ax.text(0.6, 1.12, "10% above the bound", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout lengths known this many steps ahead (0.5 = none, drawn order)")
    ax.set_ylabel("elastic makespan / lower bound")
    ax.set_title(f"{stem.name.split('_')[0]}: the price of not knowing rollout lengths", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    print(f"wrote {stem.with_suffix('.csv')}, {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
